"""Lab 4's exercises: what optimizer offload leaves on the accelerator; the ZeRO bytes rule, as code."""

from __future__ import annotations

from typing import Callable

from labkit import zero_probe
from labkit.exercises import Verdict, check_code, predict

BytesRule = Callable[[int, int, int], float]


def offloaded_accelerator_bytes(measured: list[zero_probe.RankMeasurement], prediction,
                                *, config: str = "stage 2 + optimizer->CPU") -> Verdict | None:
    """Exercise 4.1: model-state bytes left on rank 0's accelerator with the optimizer offloaded."""
    rank0 = next(m for m in measured if m.config.name == config and m.rank == 0)

    def explain(got: float) -> str:
        held = rank0.on_accelerator
        return (f"Measured on the accelerator: params {held.params:,} + grads {held.grads:,} + optimizer "
                f"{held.optimizer:,} bytes. Offload moves the Adam state (12 bytes per parameter: fp32 master, two "
                f"moments) to the host, and with it this rank's gradient partition, which CPU Adam reads there; "
                f"only the 16-bit parameters stay.")

    return predict("4.1", prediction, what=f"the bytes of model states '{config}' leaves on rank 0's accelerator",
                   measure=lambda: rank0.on_accelerator.total, context=(rank0.num_params, rank0.dp_degree),
                   tolerance=0.05, unit="bytes", explain=explain)


def bytes_rule(measured: list[zero_probe.RankMeasurement], answer) -> bool | None:
    """Exercise 4.2: ``rule(num_params, stage, ranks)`` gives every rank's measured model-state bytes at
    stages 0-3, within the lab's 5% band."""
    plain = [m for m in measured if not m.config.offloaded]

    def test(rule: BytesRule) -> str | None:
        for m in plain:
            want, got = m.model_states.total, float(rule(m.num_params, m.config.stage, m.dp_degree))
            if abs(got - want) > 0.05 * want:
                return (f"at {m.config.name}, rank {m.rank} of {m.dp_degree}, it gives {got:,.0f} bytes where "
                        f"the engine held {want:,}")
        return None

    return check_code("4.2", answer, what="a function bytes_per_rank(num_params, stage, ranks)", test=test)
