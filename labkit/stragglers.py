"""Telling a straggler from a healthy rank: the rule the supervisor applies, and what it judges.

A straggler is a rank whose node still works, only slower, and two healthy ranks on a shared machine
differ too. :class:`StragglerRule` compares each rank's compute
with the other ranks' at the same step over a window of steps; :func:`worst_window_ratio` measures
how far healthy ranks drift, the margin the rule's threshold must clear; :func:`plot_windows` shows
both runs against the threshold.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

from labkit.fault_plan import Fault
from labkit.recovery_report import RunReport, compute_times


@dataclass(frozen=True)
class StragglerRule:
    """A rank straggles when its fastest step over the last ``window`` steps is more than ``factor``
    times the other ranks' fastest over the same steps (:func:`window_ratio`).

    Why the fastest step: interference from a neighbour (a shared core, a cache, a background write)
    only ever adds time, so a node's fastest step in a window is its speed, while a slow node is slow at
    every step, its fastest included. Why steps of the same window: whatever slows every rank (a busy
    machine, a bigger batch) cancels. The price: a slow node is seen only once its whole window is slow,
    ``window`` steps after it turned (30-32 steps in 20 runs).

    Why 1.5x: on the 2-core CI box two healthy ranks' fastest steps over 31-step windows were
    1.01-1.15x apart in 26 runs, up to 1.21x apart in 6 runs beside a process streaming through a 64 MB
    array (a neighbour that evicts one rank's caches), and 1.16x apart in one CI run, a false alarm at the
    earlier 1.15x threshold. A rank doing twice the work measured 1.91-2.12x once its window was all
    slow (20 runs), and 1.79x at worst beside that neighbour. A rank doing 30% more work measured 1.17x at worst in 6 quiet runs and
    1.10x beside the neighbour: here it cannot be told from a healthy rank. Where healthy ranks drift
    less, a lower ``factor`` finds smaller slowdowns.
    (``python benchmarks/lab08_recovery_and_placement.py --only-straggler --straggler-runs 10 --elastic-pairs 0``.)

    Why ``warmup``: the first steps after a start pay one-time costs (first allocations, page faults, thread
    pools), unevenly between ranks. On a busier host than the one above, a clean job's first window
    (steps 0-30) reached 1.62x and 1.78x in 2 of about 20 jobs, false alarms at 1.5x, while in ten clean jobs
    every window from step 10 on stayed at or below 1.32x. A node that turns slow later is caught as before:
    its window is all slow steps either way.
    """

    factor: float = 1.5
    window: int = 31
    warmup: int = 10
    """Steps of each start (first launch or restart) the rule does not judge."""

    def __post_init__(self) -> None:
        if self.factor <= 1:
            raise ValueError(f"straggler factor must be > 1, got {self.factor}")
        if self.window < 1:
            raise ValueError(f"straggler window must be >= 1 step, got {self.window}")
        if self.warmup < 0:
            raise ValueError(f"straggler warmup must be >= 0 steps, got {self.warmup}")

    def is_slow(self, own_s: Sequence[float], others_s: Sequence[float]) -> bool:
        """Do the last ``window`` steps (own compute, and the other ranks' median compute) say straggler?"""
        return len(own_s) >= self.window and window_ratio(own_s[-self.window:], others_s[-self.window:]) > self.factor


def window_ratio(own_s: Sequence[float], others_s: Sequence[float]) -> float:
    """A rank's fastest step over the others' fastest, over the same steps."""
    return min(own_s) / min(others_s)


def others_median(compute_s: dict[int, float]) -> dict[int, float]:
    """rank -> the median of the other ranks' compute at one step (two ranks or more)."""
    return {rank: statistics.median(t for r, t in compute_s.items() if r != rank) for rank in compute_s}


def window_ratios(compute_s: dict[int, dict[int, float]], window: int, warmup: int = 0) -> dict[int, list[float]]:
    """rank -> :func:`window_ratio` of every full ``window`` of steps after the first ``warmup``, from step ->
    rank -> compute seconds: what :class:`StragglerRule` judges, for one attempt."""
    steps = sorted(s for s, times in compute_s.items() if len(times) > 1)[warmup:]
    others = [others_median(compute_s[s]) for s in steps]
    ranks = sorted(compute_s[steps[0]]) if steps else []
    return {rank: [window_ratio([compute_s[s][rank] for s in steps[i - window:i]], [o[rank] for o in others[i - window:i]])
                   for i in range(window, len(steps) + 1)] for rank in ranks}


def worst_window_ratio(report: RunReport, rule: StragglerRule) -> float:
    """The largest :func:`window_ratio` any rank reached in any attempt of ``report``, over the windows
    ``rule`` judges: how far apart healthy ranks drift, for its threshold to clear."""
    return max([1.0, *(r for per_step in compute_times(report).values()
                       for ratios in window_ratios(per_step, rule.window, rule.warmup).values() for r in ratios)])


def plot_windows(clean: RunReport, straggled: RunReport, fault: Fault, rule: StragglerRule):
    """Every rank's :func:`window_ratio`, step by step: the healthy run's ranks against the straggler's, with the
    rule's threshold and the step the node turned slow."""
    from labkit import plots

    fig, (ax,) = plots.figure(1, width=9, height=3.8)
    for name, report, style in (("healthy run", clean, ":"), ("straggler run", straggled, "-")):
        for attempt, per_step in compute_times(report).items():
            steps = sorted(s for s, times in per_step.items() if len(times) > 1)[rule.warmup + rule.window - 1:]
            for rank, medians in window_ratios(per_step, rule.window, rule.warmup).items():
                slow = report is straggled and rank == fault.rank and attempt == 0
                ax.plot(steps, medians, style, lw=1.6 if slow else 1.0,
                        color=plots.WARN if slow else (plots.BASELINE if report is clean else plots.FIX),
                        label=f"{name}, rank {rank}, attempt {attempt}")
    ax.axhline(rule.factor, color="black", lw=0.8, ls="--", label=f"threshold {rule.factor}x")
    ax.axvline(fault.step, color=plots.WARN, lw=0.8, ls=":", label=f"rank {fault.rank} slows (step {fault.step})")
    ax.set_xlabel(f"step (window of the {rule.window} steps ending here)")
    ax.set_ylabel("fastest step / others' fastest (x)")
    ax.set_title("measured: each rank's compute against the other ranks'")
    ax.legend(fontsize=7, ncol=2, loc="upper left")
    return fig
