"""Reference answers to Lab 4's exercises."""

from labkit.exercises import Answer

EX_4_1 = Answer(
    right=lambda num_params, ranks: 2 * num_params,   # the 16-bit parameters; the gradient partition goes down too
    wrong=lambda num_params, ranks: 2 * num_params + 2 * num_params / ranks + 12 * num_params / ranks,
    wrong_because="the whole stage-2 footprint: forgets that the optimizer state left the accelerator",
)


def _bytes_per_rank(num_params: int, stage: int, ranks: int) -> float:
    """16-bit params and grads, 12 bytes of Adam state; stage s partitions optimizer, then grads, then params."""
    params = 2 * num_params / (ranks if stage >= 3 else 1)
    grads = 2 * num_params / (ranks if stage >= 2 else 1)
    optimizer = 12 * num_params / (ranks if stage >= 1 else 1)
    return params + grads + optimizer


EX_4_2 = Answer(
    right=_bytes_per_rank,
    wrong=lambda num_params, stage, ranks: 4 * num_params + 12 * num_params / (ranks if stage >= 1 else 1),
    wrong_because="partitions only the optimizer state, as if stages 2 and 3 were stage 1",
)
