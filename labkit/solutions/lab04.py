"""Reference answers to Lab 4's exercises."""

from labkit.exercises import Answer


def _bytes_per_rank(num_params: int, stage: int, ranks: int) -> float:
    """16-bit params and grads, 12 bytes of Adam state; stage s partitions optimizer, then grads, then params."""
    params = 2 * num_params / (ranks if stage >= 3 else 1)
    grads = 2 * num_params / (ranks if stage >= 2 else 1)
    optimizer = 12 * num_params / (ranks if stage >= 1 else 1)
    return params + grads + optimizer


EX_4_1 = Answer(
    right=_bytes_per_rank,
    wrong=lambda num_params, stage, ranks: 4 * num_params + 12 * num_params / (ranks if stage >= 1 else 1),
    wrong_because="partitions only the optimizer state, as if stages 2 and 3 were stage 1",
)

EX_4_2 = Answer(
    # every block's input, one block's saved tensors (d + 4d + 4d per token) while it is recomputed, the gradients
    right=lambda blocks, width, tokens, num_params: 4 * (blocks * tokens * width + 9 * tokens * width + num_params),
    wrong=lambda blocks, width, tokens, num_params: 4 * (blocks * 9 * tokens * width + num_params),
    wrong_because="every block's saved tensors, as if nothing were recomputed",
)
