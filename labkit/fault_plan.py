"""The faults Lab 8 injects into its training job, and plans of them.

A plan is a list of :class:`Fault` (kind, rank, step), checked before any rank
starts so a fault that could never fire is an error, not a silent clean run.
:mod:`labkit.recovery_rank` fires them; :mod:`labkit.recovery` blames each
failure on the cause its kind should produce (:data:`CAUSE_OF_FAULT`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

FAULT_KINDS = ("kill", "hang", "straggle", "nan")
SUDDEN_KINDS = ("kill", "hang", "nan")
"""Faults seen at once or after a timeout, so a random plan may space them a few steps apart; a
straggler needs a window of slow steps (:class:`labkit.stragglers.StragglerRule`), so Lab 8 runs it alone."""

CAUSE_OF_FAULT = {"kill": "exit", "hang": "hang", "straggle": "straggler", "nan": "nonfinite"}


@dataclass(frozen=True)
class Fault:
    """One fault to inject: ``kind`` on ``rank`` when it is about to run ``step``."""

    kind: str
    rank: int
    step: int

    @property
    def fault_id(self) -> str:
        return f"{self.kind}-rank{self.rank}-step{self.step}"


def validate_faults(faults: Sequence[Fault], *, world_size: int, steps: int) -> list[Fault]:
    """Reject plans that could never fire, before any rank starts."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    seen_steps: set[int] = set()
    checked = []
    for fault in faults:
        if fault.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {FAULT_KINDS}, got {fault.kind!r}")
        if not 0 <= fault.rank < world_size:
            raise ValueError(f"fault {fault.fault_id}: rank must be in [0, {world_size - 1}], got {fault.rank}")
        if not 0 <= fault.step < steps:
            raise ValueError(f"fault {fault.fault_id}: step must be in [0, {steps - 1}], got {fault.step}")
        if fault.step in seen_steps:
            raise ValueError(f"fault {fault.fault_id}: two faults at step {fault.step}; give each fault its own step")
        seen_steps.add(fault.step)
        checked.append(fault)
    return sorted(checked, key=lambda f: f.step)


def random_fault_plan(
    kinds: Sequence[str], *, world_size: int, steps: int, seed: int, min_gap_steps: int = 8
) -> list[Fault]:
    """One fault of each kind at random ranks and steps (deterministic given ``seed``),
    at least ``min_gap_steps`` apart so each failure is recovered before the next."""
    rng = np.random.default_rng(seed)
    span = steps - min_gap_steps * (len(kinds) + 1)
    if span < 0:
        raise ValueError(
            f"steps must be >= {min_gap_steps * (len(kinds) + 1)} for {len(kinds)} faults "
            f"{min_gap_steps} steps apart, got {steps}"
        )
    offsets = np.sort(rng.integers(0, span + 1, len(kinds)))
    faults = [
        Fault(kind, int(rng.integers(0, world_size)), int(min_gap_steps * (i + 1) + offsets[i]))
        for i, kind in enumerate(kinds)
    ]
    return validate_faults(faults, world_size=world_size, steps=steps)
