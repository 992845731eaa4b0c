"""Split each training step into *waiting for data* and *compute*.

Utilisation counters on a GPU say the device was busy, not why it was idle. The
step meter answers the first question of Lab 1 directly: of the wall time of a
training loop, which fraction did the accelerator spend working, and which
fraction did it spend waiting for the next batch?
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterable, Iterator, TypeVar

import torch

from labkit.devices import load_average, synchronize

T = TypeVar("T")


@dataclass(frozen=True)
class MeterSummary:
    steps: int
    items: int
    wait_ms: float
    compute_ms: float
    busy_fraction: float
    items_per_s: float
    step_ms: float
    load_avg: float

    def as_row(self) -> dict[str, float]:
        return {
            "busy_fraction": round(self.busy_fraction, 3),
            "images_per_s": round(self.items_per_s, 1),
            "step_ms": round(self.step_ms, 2),
            "load_avg": round(self.load_avg, 2),
        }


@dataclass
class StepMeter:
    """Accumulates wait and compute time over steps.

    ``skip_first`` steps are timed but left out of the summary: the first batch
    pays for worker start-up, which is real but belongs to a different question.
    """

    device: torch.device | str = "cpu"
    skip_first: int = 1
    wait_ms: list[float] = field(default_factory=list)
    compute_ms: list[float] = field(default_factory=list)
    items: list[int] = field(default_factory=list)

    @contextmanager
    def waiting(self) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.wait_ms.append((time.perf_counter() - start) * 1e3)

    @contextmanager
    def computing(self, items: int) -> Iterator[None]:
        if items < 0:
            raise ValueError(f"items must be >= 0, got {items}")
        start = time.perf_counter()
        yield
        synchronize(self.device)
        self.compute_ms.append((time.perf_counter() - start) * 1e3)
        self.items.append(items)

    def iterate(self, batches: Iterable[T]) -> Iterator[T]:
        """Yield batches, timing each fetch as waiting."""
        iterator = iter(batches)
        done = object()
        while True:
            with self.waiting():
                batch = next(iterator, done)
            if batch is done:
                self.wait_ms.pop()
                return
            yield batch

    def summary(self) -> MeterSummary:
        steps = min(len(self.wait_ms), len(self.compute_ms))
        keep = slice(min(self.skip_first, max(steps - 1, 0)), steps)
        wait, compute, items = self.wait_ms[keep], self.compute_ms[keep], self.items[keep]
        if not compute:
            raise RuntimeError("no steps were measured; run at least skip_first + 1 steps")
        total_ms = sum(wait) + sum(compute)
        return MeterSummary(
            steps=len(compute),
            items=sum(items),
            wait_ms=sum(wait),
            compute_ms=sum(compute),
            busy_fraction=sum(compute) / total_ms if total_ms else 0.0,
            items_per_s=sum(items) / (total_ms / 1e3) if total_ms else 0.0,
            step_ms=total_ms / len(compute),
            load_avg=load_average(),
        )
