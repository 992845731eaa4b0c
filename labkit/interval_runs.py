"""Goodput measured at three checkpoint intervals: the Young/Daly trade-off run, not only modelled.

Lab 8's interval curve is a model. Here real training loops run the trade-off it describes: each saves a
real checkpoint (``torch.save`` into :func:`labkit.atomic.atomic_file`: written, fsynced, renamed) every
``interval`` steps, and when a failure arrives it throws its model and optimizer away, loads the last
checkpoint from the disk and redoes the steps since. Saves, reloads and redone steps are all measured;
goodput is :func:`labkit.interval.goodput`, useful work over the time it took, set beside
:func:`labkit.interval.goodput_fraction` fed with the step, save and reload times the same loops measured.

**Runs in turns.** The three intervals, and a fourth loop that neither saves nor fails (the baseline),
advance one step each in turn, and each keeps its own clock: the time spent in its own steps, saves and
reloads. Load from other programs then hits all four alike. Run one after another, 2-second runs on a
shared 2-core machine drifted apart by up to 30% in step time, more than the interval moved them.
Useful work is the baseline's time for the same steps, so a loop never gains from its own slowness. The
loops below the longest interval run a share of its steps (:attr:`IntervalSizes.shorter_share`) and stop,
their goodput set against the baseline's time for as many steps: 7.9-10.0 s for the loops in five runs, against
11.4-12.7 s in four with every loop running all the steps, at the same 1.3-1.4 ms save.

**The emulated condition** is when failures arrive: one in each window of ``mtbf_s`` seconds of a loop's
own clock, at a seeded uniform point of the window, the same points for every interval. That is the
model's failure rate with its arrivals spread evenly; a Poisson process would need many more failures
per run to average the work a failure loses. The MTBF is set from a save timed before the runs
(``mtbf_over_optimum`` times the Young/Daly interval it implies), so that save's optimum lands in the middle of
the three intervals on any machine. A real job also restarts its processes after a failure (Lab 8
measures that in its faulted run); that costs the same at every interval, so here a failure costs the
reload and the redone steps only.

The loops run on the CPU whatever the profile (what they measure is saves and failures, not compute), in
a process of their own started by :func:`labkit.launcher.launch`, as a training job runs apart from the
notebook that watches it. Run in the notebook's kernel instead, they left it slower at launching ranks:
Lab 8's two-rank job in one zone then stepped 1.3-1.7x the simulator's time in every later run in that
kernel (1.0-1.3x before). Batches depend only on the step, so every loop ends on the weights the baseline
had after as many steps.

Spread (``ci`` sizes, a 2-core machine). Counted in steps, as first built, the interval drifted against the
MTBF (see :class:`_Loop`) and one full test run measured outside 0.8-1.2x at four times the optimum. Counted
in time, eighteen runs gave measured over modelled goodput 1.01-1.03x at a quarter of the optimum, 0.96-1.01x
at it and 0.92-1.14x at four times it, the middle best in all. There an interval is half the MTBF, so each
failure loses anywhere from nothing to half an MTBF of work: replayed step by step at a constant step time
(``benchmarks/interval_arrival_draws.py``), seed 0's arrival points give 1.02x and 600 other seeds 0.89-1.18x,
sd 0.05: the draw, not the machine, sets most of that spread. With the shorter intervals at half the steps,
ten runs of Lab 8 gave 1.010-1.031x, 0.975-1.008x and 0.985-1.062x, the middle best in all, the loops taking
9.6-24.3 s (12.7-27.2 s in ten runs before; the length follows the save timed before the runs).
"""

from __future__ import annotations

import hashlib
import random
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from labkit.atomic import atomic_file
from labkit.interval import goodput, goodput_fraction, young_daly_interval_s
from labkit.launcher import launch
from labkit.profiles import require_at_least

AGREEMENT_BAND = (0.8, 1.2)
"""Measured over modelled goodput, at every interval; eighteen runs gave 0.92-1.14 (see the module docstring)."""


@dataclass(frozen=True)
class IntervalSizes:
    """The loop (an MLP ``width`` wide on ``batch`` samples) and the experiment around it."""

    width: int
    batch: int
    failures: int
    """The useful work of each loop, in MTBF windows: about this many failures each (more where goodput is lower)."""
    mtbf_over_optimum: float = 8.0
    """MTBF over the Young/Daly interval; the first-order model holds while an interval is well under the MTBF."""
    factors: tuple[float, ...] = (0.25, 1.0, 4.0)
    """The intervals run, as multiples of the Young/Daly interval."""
    seed: int = 0
    shorter_share: float = 0.5
    """The useful work of the loops below the longest interval, as a share of the longest's (and the baseline's).
    A failure loses up to one interval of work, so the longest interval's goodput varies most with where the
    failures fall and needs the most of them. Replayed over 300 seeds (``benchmarks/interval_arrival_draws.py``),
    measured over modelled goodput had sd 0.051 at four times the optimum with 12 failures' work, and 0.004 at a
    quarter of it and 0.016 at it with half that work (0.003 and 0.011 with all of it, over 1000 seeds)."""

    def __post_init__(self) -> None:
        require_at_least(self, 1, "width", "batch", "failures")
        if not self.factors or min(self.factors) <= 0:
            raise ValueError(f"factors must all be > 0, got {self.factors}")
        if not 0 < self.shorter_share <= 1:
            raise ValueError(f"shorter_share must be in (0, 1], got {self.shorter_share}")
        if not self.mtbf_over_optimum >= 2 * max(self.factors):
            raise ValueError(f"mtbf_over_optimum must be at least twice the largest factor ({max(self.factors):g}), "
                             f"got {self.mtbf_over_optimum}")


_SIZE = IntervalSizes(width=64, batch=64, failures=12)
SIZES = {"ci": _SIZE, "gpu": _SIZE, "multi-gpu": _SIZE}
"""One size everywhere: the loops run on the CPU (see the module docstring). Twelve failures' work for the longest
interval and the baseline (the others half that), not eight:
with eight (and a model twice as wide) the longest interval measured 0.97-1.18x the model in ten runs, with
twelve 1.01-1.07x in six, in the same time (a save costs about as much either way, mostly its fsyncs)."""


@dataclass(frozen=True)
class Costs:
    """A step, a save, a reload (seconds) and the failure rate: what the model is fed."""

    step_s: float
    save_s: float
    reload_s: float
    mtbf_s: float

    @property
    def optimum_s(self) -> float:
        return young_daly_interval_s(self.save_s, self.mtbf_s)

    def modelled_goodput(self, interval_s: float) -> float:
        return goodput_fraction(interval_s, self.save_s, self.mtbf_s, self.reload_s)


class _Trainer:
    """An MLP and its Adam state; a batch depends only on the step."""

    def __init__(self, sizes: IntervalSizes) -> None:
        torch.manual_seed(sizes.seed)
        self.sizes = sizes
        self.model = torch.nn.Sequential(torch.nn.Linear(sizes.width, sizes.width), torch.nn.ReLU(),
                                         torch.nn.Linear(sizes.width, sizes.width))
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3)

    def step(self, position: int) -> None:
        x = torch.randn(self.sizes.batch, self.sizes.width, generator=torch.Generator().manual_seed(position))
        loss = (self.model(x) - x).pow(2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()

    def save(self, path: Path, position: int) -> None:
        with atomic_file(path) as tmp:
            torch.save({"position": position, "model": self.model.state_dict(),
                        "optimizer": self.optimizer.state_dict()}, tmp)

    @classmethod
    def load(cls, sizes: IntervalSizes, path: Path) -> tuple["_Trainer", int]:
        """A fresh trainer from the checkpoint, as a restarted job builds one."""
        trainer, state = cls(sizes), torch.load(path)
        trainer.model.load_state_dict(state["model"])
        trainer.optimizer.load_state_dict(state["optimizer"])
        return trainer, state["position"]

    def weights_sha256(self) -> str:
        """A digest of the weights' bytes: equal digests, bit-identical weights."""
        weights = torch.cat([p.detach().flatten() for p in self.model.parameters()])
        return hashlib.sha256(weights.numpy().tobytes()).hexdigest()


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def calibrate(sizes: IntervalSizes, folder: Path) -> Costs:
    """A median step and reload, and the fastest of seven saves, before the runs: the save sets the MTBF and
    the intervals, and so the experiment's length (it runs about ``failures`` MTBFs per loop). Noise only
    slows a save: in ten runs of Lab 8 the median of seven set an MTBF of 0.20-0.48 s (0.20-0.26 s in seven),
    in twenty the fastest 0.17-0.53 s (0.17-0.21 s in fifteen; above that the disk's fsyncs were slow for the
    whole run), and the loops measured the model's goodput as closely (0.97-1.07x)."""
    trainer = _Trainer(sizes)
    for position in range(5):
        trainer.step(position)
    step_s = statistics.median(_timed(lambda: trainer.step(0)) for _ in range(30))
    path = folder / "calibration.pt"
    save_s = min(_timed(lambda: trainer.save(path, 0)) for _ in range(7))
    reload_s = statistics.median(_timed(lambda: _Trainer.load(sizes, path)) for _ in range(5))
    optimum_s = 2 * save_s * sizes.mtbf_over_optimum   # sqrt(2 C M) with M = k sqrt(2 C M)
    return Costs(step_s, save_s, reload_s, mtbf_s=sizes.mtbf_over_optimum * optimum_s)


class Arrivals:
    """Failure arrivals on a loop's own clock: one in each window of ``mtbf_s`` seconds, at a seeded uniform
    point of the window, for as long as the loop runs (the emulated condition). Every loop meets the same points.

    Arrivals go on until the loop ends: a loop that loses more time to failures also meets more of them, as
    at the model's rate. (With a fixed number of arrivals, the loops with the lowest goodput met fewer
    failures per second than the model, and measured 4-14% above it.) Points spread by a low-discrepancy
    sequence instead of drawn were tried: they fell at the same places within the longest interval run
    after run, which then lost less work than the model in 5 of 10 runs (1.24-1.26x).
    """

    def __init__(self, mtbf_s: float, seed: int) -> None:
        if not mtbf_s > 0:
            raise ValueError(f"mtbf_s must be > 0, got {mtbf_s}")
        self.mtbf_s, self._draw, self._points = mtbf_s, random.Random(seed), []

    def __getitem__(self, index: int) -> float:
        while len(self._points) <= index:
            self._points.append((len(self._points) + self._draw.random()) * self.mtbf_s)
        return self._points[index]


SETTLING_ROUNDS = 200
"""After this many steps in turns, the steps to run are set from the baseline's own mean step, so a loop meets
about ``failures`` failures: a median step timed alone just before ranged 0.48-1.09 ms against 0.53-0.83 ms in
the runs that followed, and runs met 8 to 24 failures where the step count came from it; set from the pace,
six runs met 13 to 27 (more where goodput is lower). Never below half the first count: a loop is then still
far from done."""


class _Loop:
    """One training loop that saves once ``interval_s`` of its steps' time has passed since its last save
    (0: never), and rolls back at each arrival.

    The interval is time on the loop's own clock, as the model's is. Counted in steps it drifts against the
    MTBF with the step time: in three runs a step took 0.57-0.88 ms in the loops and a save 1.5-3.2 ms, up
    to 1.7x their calibration a moment before, so an interval of four times the optimum ran 0.45-0.67 of
    the MTBF instead of 0.5, and measured 0.93-1.15x the model, rising with that fraction.
    """

    def __init__(self, sizes: IntervalSizes, interval_s: float, useful_steps: int, arrivals: Arrivals | None,
                 path: Path) -> None:
        self.sizes, self.interval_s, self.useful_steps = sizes, interval_s, useful_steps
        self.arrivals, self.path = arrivals, path
        self.trainer, self.position, self.saved_at = _Trainer(sizes), 0, 0
        if interval_s:
            self.trainer.save(path, 0)
        self.elapsed_s = self.save_s = self.reload_s = 0.0
        self.since_save_s = 0.0   # step time since the last save (or reload)
        self.stretch_s, self.full_stretches = 0.0, 0   # the stretches a full interval closed: their mean is the interval
        self.saves = self.failures = self.redone_steps = 0

    @property
    def measured_interval_s(self) -> float:
        """The mean step time between two saves (each stretch overshoots ``interval_s`` by part of a step)."""
        return self.stretch_s / self.full_stretches if self.full_stretches else self.interval_s

    @property
    def done(self) -> bool:
        return self.position >= self.useful_steps

    def advance(self) -> None:
        """One step, then the save or the failure it is due; the time goes on this loop's own clock."""
        start = time.perf_counter()
        self.trainer.step(self.position)
        self.position += 1
        self.since_save_s += time.perf_counter() - start
        if self.interval_s and (self.since_save_s >= self.interval_s or self.done):
            self.save_s += _timed(lambda: self.trainer.save(self.path, self.position))
            self.saves, self.saved_at = self.saves + 1, self.position
            if self.since_save_s >= self.interval_s:   # not the last, shorter stretch a save at the end closes
                self.full_stretches, self.stretch_s = self.full_stretches + 1, self.stretch_s + self.since_save_s
            self.since_save_s = 0.0
        clock = self.elapsed_s + time.perf_counter() - start
        if self.arrivals is not None and clock >= self.arrivals[self.failures] and not self.done:
            self.failures, self.redone_steps = self.failures + 1, self.redone_steps + self.position - self.saved_at
            began = time.perf_counter()
            self.trainer, self.position = _Trainer.load(self.sizes, self.path)
            self.reload_s, self.since_save_s = self.reload_s + time.perf_counter() - began, 0.0
        self.elapsed_s += time.perf_counter() - start


@dataclass(frozen=True)
class IntervalRun:
    """One loop at one checkpoint interval: what its own clock was spent on."""

    factor: float
    interval_s: float
    """The interval measured: the mean step time between two saves, on the loop's own clock."""
    useful_steps: int
    elapsed_s: float
    baseline_s: float
    """The baseline loop's time for the same steps, neither saving nor failing: the useful work."""
    saves: int
    save_s: float
    failures: int
    reload_s: float
    redone_steps: int
    weights_sha256: str
    """The final weights' digest."""
    baseline_sha256: str
    """The baseline's weights' digest after as many steps."""

    @property
    def goodput(self) -> float:
        return goodput(self.baseline_s, self.elapsed_s)


@dataclass(frozen=True)
class IntervalExperiment:
    """The three loops, the costs they measured (fed to the model) and the calibration that set the MTBF."""

    calibration: Costs
    costs: Costs
    runs: list[IntervalRun]

    def modelled(self, run: IntervalRun) -> float:
        return self.costs.modelled_goodput(run.interval_s)

    def ratios(self) -> list[float]:
        """Measured over modelled goodput, one per interval."""
        return [run.goodput / self.modelled(run) for run in self.runs]

    def best(self) -> IntervalRun:
        """The interval whose loop measured the highest goodput."""
        return max(self.runs, key=lambda run: run.goodput)

    def same_weights(self) -> bool:
        """Every loop, whatever it redid, ended on the weights the baseline had after as many steps, bit for bit."""
        return all(run.weights_sha256 == run.baseline_sha256 for run in self.runs)

    def describe(self) -> str:
        c, cal = self.costs, self.calibration
        lines = [f"measured in the loops: step {c.step_s * 1e3:.2f} ms, save {c.save_s * 1e3:.2f} ms, reload "
                 f"{c.reload_s * 1e3:.2f} ms; emulated MTBF {c.mtbf_s:.2f} s; Young/Daly interval from the loops' "
                 f"saves {c.optimum_s * 1e3:.0f} ms",
                 f"calibration save before the loops {cal.save_s * 1e3:.2f} ms: Young/Daly interval "
                 f"{cal.optimum_s * 1e3:.0f} ms, the middle interval's setting (the others are set as multiples of it)"]
        for run in self.runs:
            lines.append(
                f"every {run.interval_s * 1e3:4.0f} ms of steps (x{run.factor:g} the calibrated interval): "
                f"{run.saves:3d} saves {run.save_s:4.2f} s, {run.failures:2d} failures, {run.redone_steps:4d} steps "
                f"redone, reloads {run.reload_s:4.2f} s; {run.elapsed_s:4.2f} s against the baseline's "
                f"{run.baseline_s:4.2f} s: goodput measured {run.goodput:.3f}, modelled {self.modelled(run):.3f}")
        return "\n".join(lines)


def _measured_costs(baseline: _Loop, loops: list[_Loop], mtbf_s: float) -> Costs:
    """Per-step, per-save and per-reload means over the runs themselves: the costs the points paid."""
    saves, failures = sum(loop.saves for loop in loops), sum(loop.failures for loop in loops)
    return Costs(step_s=baseline.elapsed_s / baseline.useful_steps,
                 save_s=sum(loop.save_s for loop in loops) / max(saves, 1),
                 reload_s=sum(loop.reload_s for loop in loops) / max(failures, 1), mtbf_s=mtbf_s)


def measure_here(sizes: IntervalSizes, folder: str) -> IntervalExperiment:
    """Calibrate, then run the loops in turns, saving in ``folder``; writes ``steps done/steps to do`` to
    ``folder/progress`` as it goes (for :func:`measure`'s bar)."""
    work, ticker = Path(folder), Path(folder) / "progress"
    calibration = calibrate(sizes, work)
    longest = max(sizes.factors)
    shares = [1.0 if f == longest else sizes.shorter_share for f in sizes.factors]
    useful_steps = round(sizes.failures * calibration.mtbf_s / calibration.step_s)
    loops = [_Loop(sizes, f * calibration.optimum_s, round(useful_steps * share),
                   Arrivals(calibration.mtbf_s, sizes.seed), work / f"every-{f:g}x.pt")
             for f, share in zip(sizes.factors, shares)]
    baseline = _Loop(sizes, 0.0, useful_steps, None, work / "baseline.pt")
    clock, digest = [0.0], {}   # the baseline's clock after each step; its weights where a loop stops
    everyone = [baseline, *loops]
    rounds = 0
    while not all(loop.done for loop in everyone):
        for loop in everyone:
            if not loop.done:
                loop.advance()
                if loop is baseline:   # it never fails: one step, one position
                    clock.append(baseline.elapsed_s)
                    if any(other.useful_steps == baseline.position for other in loops):
                        digest[baseline.position] = baseline.trainer.weights_sha256()
        rounds += 1
        if rounds == SETTLING_ROUNDS and not baseline.done:
            useful_steps = max(useful_steps // 2, round(sizes.failures * calibration.mtbf_s * rounds / baseline.elapsed_s))
            baseline.useful_steps = useful_steps
            for loop, share in zip(loops, shares):   # never a step the baseline has passed: its weights are kept there
                loop.useful_steps = max(round(useful_steps * share), baseline.position + 1)
        if rounds % 200 == 0:
            ticker.write_text(f"{sum(loop.position for loop in everyone)}/{sum(loop.useful_steps for loop in everyone)}")
    costs = _measured_costs(baseline, loops, calibration.mtbf_s)
    runs = [IntervalRun(f, loop.measured_interval_s, loop.useful_steps, loop.elapsed_s, clock[loop.useful_steps],
                        loop.saves, loop.save_s, loop.failures, loop.reload_s, loop.redone_steps,
                        loop.trainer.weights_sha256(), digest[loop.useful_steps])
            for f, loop in zip(sizes.factors, loops)]
    return IntervalExperiment(calibration, costs, runs)


def measure(sizes: IntervalSizes, progress: Any = None, timeout_s: float = 300.0) -> IntervalExperiment:
    """:func:`measure_here` in a process of its own, in a temporary folder removed afterwards.

    ``progress``: a tqdm-like bar, moved to the steps the four loops have kept so far.
    """
    with tempfile.TemporaryDirectory(prefix="labkit-intervals-") as folder:
        stop = threading.Event()
        watcher = threading.Thread(target=_follow, args=(Path(folder) / "progress", progress, stop), daemon=True,
                                   name="labkit-interval-progress")
        watcher.start()
        try:
            [experiment] = launch(measure_here, 1, init_process_group=False, timeout_s=timeout_s, sizes=sizes,
                                  folder=folder)
        finally:
            stop.set()
            watcher.join()
    if progress is not None:
        progress.n = progress.total or 0
        progress.refresh()
    return experiment


def _follow(ticker: Path, progress: Any, stop: threading.Event) -> None:
    """Move ``progress`` to what ``ticker`` says until ``stop`` is set."""
    while progress is not None and not stop.wait(0.25):
        try:
            done, total = (int(part) for part in ticker.read_text().split("/"))
        except (OSError, ValueError):   # not written yet, or caught mid-write
            continue
        progress.total, progress.n = total, min(done, total)
        progress.refresh()


def plot(ax, experiment: IntervalExperiment) -> None:
    """The model's curve over the intervals (a line), the measured goodputs as points on it."""
    from labkit import plots

    runs, costs = experiment.runs, experiment.costs
    low, high = min(r.interval_s for r in runs) / 2, max(r.interval_s for r in runs) * 2
    xs = [low * (high / low) ** (i / 99) for i in range(100)]
    ax.plot([x * 1e3 for x in xs], [costs.modelled_goodput(x) for x in xs], "-", color=plots.BASELINE, lw=2,
            label="modelled: Young/Daly, fed with the loops' measured costs")
    ax.plot([r.interval_s * 1e3 for r in runs], [r.goodput for r in runs], "o", color=plots.FIX, markersize=9,
            label="measured: training loops that save and fail")
    ax.axvline(costs.optimum_s * 1e3, color=plots.GOOD, lw=1, ls="--",
               label="modelled optimum sqrt(2 x save x MTBF),\nwith the loops' mean save")
    ax.set_xscale("log")
    ax.set_ylim(0.5, 1.0)
    ax.set_xlabel("checkpoint interval (ms of work between saves)")
    ax.set_ylabel("goodput (useful / elapsed)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8)   # outside: the points reach every corner
