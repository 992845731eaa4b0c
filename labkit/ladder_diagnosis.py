"""Lab 1's pair through ``labkit diagnose``: the file path's starving loader against the transformed cache.

The course's diagnosis tool must name the bottleneck where the truth is known. Each feed trains the
lab's accelerator for a few steps inside :class:`labkit.diagnose.Diagnosis`, both through a
``DataLoader``, as a learner's own script would read them: the file path (workers read, decode, resize
and flip every image) and the transformed cache (a ``DataLoader`` over the memory-mapped pixels, read
from the disk). The accelerator computes in a process of its own on a CPU-only machine, so no optimizer
steps on the training thread; the loop marks its steps (:meth:`Diagnosis.step`), and the accelerator's
step shows in the trace as :data:`labkit.step_attribution.ACCELERATOR_SPAN`.

Beside the profile, the lab's step meter times the same steps with its own clock, as it timed every
rung: its waiting share (time in ``next()`` over the steps' wall time) is the independent measure of
the profile's data share.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from torch.utils.data import DataLoader, IterableDataset

from labkit import loaders, pagecache
from labkit.diagnosis_report import Verdict, stacked_shares, verdict
from labkit.ladder import Ladder
from labkit.meter import StepMeter

DIAGNOSED_STEPS = 6
"""Steps each feed is profiled for, after :data:`UNPROFILED_STEPS` and :data:`WARMUP_STEPS`: 12 of the file
path's 13 batches on the ``ci`` profile, so one epoch holds them and no worker restarts inside the window.
An even number: two workers sharing one core finish their batches together, so the file path's steps
alternate short and long, and an odd window read a data share of 0.39 in one run and 0.56 in the next."""
UNPROFILED_STEPS = 5
"""Steps timed without the profiler first: what the profiler itself costs (``Diagnosis.baseline_steps``;
the four after the first, two of those pairs)."""
WARMUP_STEPS = 1

LOOP_CLOCK_AGREEMENT = 0.10
"""Largest gap between the profile's data share and the step meter's waiting share over the same steps. Ten
runs of Lab 1 on the 2-core CI box (``python benchmarks/ten_runs.py --runs 10 1``) found the file path's
data share at 62-72% and the cache's at 4-5%, each within 1 point of the meter; the profiler cost 0.75-1.11x.
The step the cache saved (71-78% of the file path's) ran 3-14 points above the data share: the accelerator's
own step took longer while the loader's workers decoded on the chip beside it. (With the accelerator's width
the one nearest its target rather than the widest fast enough, the file path's share was 46-70%, once under
the compute share: :data:`labkit.ladder.ACCELERATOR_OVER_LOADER`.)"""


@dataclass(frozen=True)
class DiagnosedFeed:
    """One feed as the diagnosis split it, and the step meter's waiting share over the same steps."""

    feed: str
    shares: dict[str, float]
    step_ms: float
    overhead: float
    """Profiled step time over unprofiled: what the profiler itself cost."""
    meter_wait_share: float

    @property
    def verdict(self) -> Verdict:
        return verdict(self.shares)


class _Batches(IterableDataset):
    """A feed of whole batches (``make()`` per pass) behind a ``DataLoader``, as a script would read a cache."""

    def __init__(self, make: Callable[[], Iterable[loaders.Batch]]):
        self.make = make

    def __iter__(self) -> Iterator[loaders.Batch]:
        return iter(self.make())


def feeds(run: Ladder, cache: loaders.TransformedCache) -> dict[str, Callable[[], DataLoader]]:
    """The baseline and the fix, each a ``DataLoader`` made fresh when called."""
    sizes = run.sizes

    def from_disk() -> loaders.InRamBatches:
        pagecache.drop(cache.path)   # read from the disk, as the lab's rung does
        return cache.loader(batch_size=sizes.batch_size, device=run.device)

    return {
        "files": lambda: loaders.file_loader(run.paths, run.labels, batch_size=sizes.batch_size,
                                             image_px=sizes.image_px, num_workers=sizes.workers),
        "transformed cache": lambda: DataLoader(_Batches(from_disk), batch_size=None),
    }


def diagnose_feed(run: Ladder, name: str, loader: DataLoader, out: Path) -> DiagnosedFeed:
    """Train ``run``'s accelerator from ``loader`` under the profiler until its steps are recorded."""
    from labkit.diagnose import Diagnosis

    needed = UNPROFILED_STEPS + WARMUP_STEPS + DIAGNOSED_STEPS
    meter = StepMeter(device=run.device, skip_first=0)
    with run.accelerator.host_side(), Diagnosis(out / name.replace(" ", "-"), steps=DIAGNOSED_STEPS,
                                                warmup=WARMUP_STEPS, baseline_steps=UNPROFILED_STEPS,
                                                steps_from_optimizer=False) as probe:
        for images, labels in meter.iterate(loader):
            with meter.computing(len(images), run.accelerator.stolen_ms):
                run.accelerator.step(images, labels)
            probe.step()
            if probe.result is not None:
                break
    if probe.result is None:
        raise ValueError(f"the {name} feed ended after {probe.steps_seen} steps; the diagnosis needs {needed}")
    start, end = probe.profiled_window
    first = UNPROFILED_STEPS + WARMUP_STEPS   # the loop's step i ends at the profiler's mark i
    waited_ms = sum(meter.wait_ms[first: first + DIAGNOSED_STEPS])
    result = probe.result
    return DiagnosedFeed(name, result.shares, result.step_ms, result.overhead, waited_ms / (1e3 * (end - start)))


def diagnose_pair(run: Ladder, cache: loaders.TransformedCache) -> dict[str, DiagnosedFeed]:
    """The file path and the transformed cache, each diagnosed in turn (their traces in a folder removed after)."""
    with tempfile.TemporaryDirectory(prefix="labkit-ladder-diagnose-") as traces:
        return {name: diagnose_feed(run, name, make(), Path(traces)) for name, make in feeds(run, cache).items()}


def plot_pair(diagnosed: dict[str, DiagnosedFeed]):
    """Each feed's step as the diagnosis split it, with the step meter's waiting share marked on it."""
    from labkit import plots

    fig, (ax,) = plots.figure(1, width=8, height=2.6)
    labels = [f"{d.feed}\n{d.step_ms:.0f} ms a step" for d in diagnosed.values()]
    stacked_shares(ax, labels, [d.shares for d in diagnosed.values()])
    ax.scatter([100 * d.meter_wait_share for d in diagnosed.values()], labels, marker="|", s=900, color="black",
               zorder=3, label="step meter's waiting share (measured)")
    ax.legend(ncol=4, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    ax.set_title("measured: each step split by labkit diagnose")
    return fig
