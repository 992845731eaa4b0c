"""Split each training step into *waiting for data* and *compute*.

Utilisation counters on a GPU say the device was busy, not why it was idle. The
step meter answers the first question of Lab 1 directly: of the wall time of a
training loop, which fraction did the accelerator spend working, and which
fraction did it spend waiting for the next batch?

One accounting rule, for Labs 1 and 2 alike: a step's *wait* is the wall time
of fetching its batch; its *compute* is the wall time from handing the batch
over (the copy to the device included) until the accelerator is done, less the
time the accelerator was *stolen*: runnable, but its core held by another
program (see :meth:`labkit.accelerator.CoreAccelerator.stolen_ms`). A GPU is
not time-shared with the machine's other programs, so the summary answers
"how busy would the accelerator have been with its core to itself?":

* if the next batch was not ready when the step ended (its fetch took over
  :data:`READY_FRACTION` of the step's compute), the loader was behind; it
  used the stolen time to decode and would have made the accelerator wait
  that long anyway, so the stolen time counts as *waiting*;
* if the next batch was ready, the accelerator set the pace, and the stolen
  time is left out of the wall time.

On a quiet machine, or a GPU, nothing is stolen and both rules are the plain
wall-clock split. The summary reports how much was stolen.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, TypeVar

import torch

from labkit.devices import load_average, synchronize

T = TypeVar("T")

READY_FRACTION = 0.1
"""A fetch shorter than this fraction of the previous step's compute found its batch ready."""


@dataclass(frozen=True)
class MeterSummary:
    """Totals over the kept steps, by the module's accounting rule.

    ``wait_ms`` includes stolen time the loader needed; ``stolen_ms`` is all the
    time the accelerator's core was held by other programs, for the record.
    """

    steps: int
    items: int
    wait_ms: float
    compute_ms: float
    stolen_ms: float
    busy_fraction: float
    items_per_s: float
    step_ms: float
    load_avg: float

    def as_row(self) -> dict[str, float]:
        return {
            "busy_fraction": round(self.busy_fraction, 3),
            "images_per_s": round(self.items_per_s, 1),
            "step_ms": round(self.step_ms, 2),
            "stolen_ms_per_step": round(self.stolen_ms / self.steps, 2),
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
    stolen_ms: list[float] = field(default_factory=list)
    items: list[int] = field(default_factory=list)

    @contextmanager
    def waiting(self) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.wait_ms.append((time.perf_counter() - start) * 1e3)

    @contextmanager
    def computing(self, items: int, stolen_ms: Callable[[], float] | None = None) -> Iterator[None]:
        """Time one step's compute; ``stolen_ms()``, asked after it, says how much of it was stolen."""
        if items < 0:
            raise ValueError(f"items must be >= 0, got {items}")
        start = time.perf_counter()
        yield
        synchronize(self.device)
        elapsed_ms = (time.perf_counter() - start) * 1e3
        stolen = min(max(stolen_ms(), 0.0), elapsed_ms) if stolen_ms else 0.0
        self.compute_ms.append(elapsed_ms - stolen)
        self.stolen_ms.append(stolen)
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

    def _stolen_while_loader_behind(self, first: int, steps: int) -> float:
        """Stolen time of the kept steps after which the next batch was not ready (see the module doc)."""
        return sum(self.stolen_ms[i] for i in range(first, steps)
                   if i + 1 < len(self.wait_ms) and self.wait_ms[i + 1] > READY_FRACTION * self.compute_ms[i])

    def summary(self) -> MeterSummary:
        steps = min(len(self.wait_ms), len(self.compute_ms))
        keep = slice(min(self.skip_first, max(steps - 1, 0)), steps)
        wait, compute, items = self.wait_ms[keep], self.compute_ms[keep], self.items[keep]
        stolen = self.stolen_ms[keep]
        if not compute:
            raise RuntimeError("no steps were measured; run at least skip_first + 1 steps")
        wait_ms = sum(wait) + self._stolen_while_loader_behind(keep.start, steps)
        total_ms = wait_ms + sum(compute)
        return MeterSummary(
            steps=len(compute),
            items=sum(items),
            wait_ms=wait_ms,
            compute_ms=sum(compute),
            stolen_ms=sum(stolen),
            busy_fraction=sum(compute) / total_ms if total_ms else 0.0,
            items_per_s=sum(items) / (total_ms / 1e3) if total_ms else 0.0,
            step_ms=total_ms / len(compute),
            load_avg=load_average(),
        )
