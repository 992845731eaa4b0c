"""Lab 4's exercises: the ZeRO bytes rule, as code; what a checkpointed step adds at its peak."""

from __future__ import annotations

from typing import Callable

from labkit import recompute, zero_probe
from labkit.exercises import Verdict, check_code, predict

BytesRule = Callable[[int, int, int], float]


def bytes_rule(measured: list[zero_probe.RankMeasurement], answer) -> bool | None:
    """Exercise 4.1: ``rule(num_params, stage, ranks)`` gives every rank's measured model-state bytes at
    stages 0-3, within the lab's 5% band."""
    plain = [m for m in measured if not m.config.offloaded]

    def test(rule: BytesRule) -> str | None:
        for m in plain:
            want, got = m.model_states.total, float(rule(m.num_params, m.config.stage, m.dp_degree))
            if abs(got - want) > 0.05 * want:
                return (f"at {m.config.name}, rank {m.rank} of {m.dp_degree}, it gives {got:,.0f} bytes where "
                        f"the engine held {want:,}")
        return None

    return check_code("4.1", answer, what="a function bytes_per_rank(num_params, stage, ranks)", test=test)


def checkpointed_peak_bytes(size: recompute.RecomputeSize, prediction, *, device: str = "cpu") -> Verdict | None:
    """Exercise 4.2: the peak memory one checkpointed step of ``size``'s MLP stack adds, measured now."""
    kept = recompute.KINDS[1]

    def explain(got: float) -> str:
        return (f"Checkpointed, each of the {size.blocks} blocks keeps only its input ({size.tokens} x {size.width} "
                f"fp32), and during the backward one block at a time holds its saved tensors again (its input, the "
                f"GELU's input and the second Linear's input: 9 x {size.width} per token); the parameters' gradients "
                f"({size.num_params:,} x 4 bytes) come on top. The rest of the {got:,.0f} bytes measured are gradients "
                f"of activations in flight and the kernels' temporaries.")

    return predict("4.2", prediction, what=f"the bytes one checkpointed step of the {size.blocks}-block stack adds at its peak",
                   measure=lambda: recompute.measure_peaks(size, device=device)[kept],
                   context=(size.blocks, size.width, size.tokens, size.num_params),
                   tolerance=0.15, unit="bytes", explain=explain)
