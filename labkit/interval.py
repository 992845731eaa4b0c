"""How often to checkpoint: the Young/Daly model, as pure functions.

Checkpointing too often wastes time saving; too rarely wastes the work redone
after each failure. Young (1974) balanced the two to first order: with a save
that costs ``C`` seconds of training time and a mean time between failures ``M``,
the best interval of useful work between saves is ``sqrt(2 C M)``; Daly (2006)
refined it for ``C`` close to ``M``. What matters for a training run is the
*blocking* cost: an asynchronous save that blocks for a fraction of the write
lowers ``C``, so the best interval shrinks and less work is lost per failure.

Everything here is pure arithmetic on seconds, so the widgets in the notebook and
the unit tests call the same functions; :func:`simulate_goodput` checks the
first-order model against simulated failures (seeded, so also repeatable).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def _non_negative(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def young_daly_interval_s(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum ``sqrt(2 * cost * MTBF)`` (seconds of work between saves)."""
    _positive("checkpoint_cost_s", checkpoint_cost_s)
    _positive("mtbf_s", mtbf_s)
    return math.sqrt(2.0 * checkpoint_cost_s * mtbf_s)


def expected_lost_work_s(interval_s: float, checkpoint_cost_s: float) -> float:
    """Work redone per failure: a failure lands uniformly within one period of
    ``interval + cost``, so on average half a period is lost."""
    _positive("interval_s", interval_s)
    _non_negative("checkpoint_cost_s", checkpoint_cost_s)
    return (interval_s + checkpoint_cost_s) / 2.0


def goodput(useful_s: float, wall_s: float) -> float:
    """Measured goodput: seconds of useful training over the wall-clock seconds they took.

    One definition for every lab. *Useful* is what the training work would cost
    undisturbed; *wall* runs from the first step to the last byte committed, so a
    save's blocking, a step slowed by a background writer, the final write, a
    restart and redone work all count against it.
    """
    _non_negative("useful_s", useful_s)
    _positive("wall_s", wall_s)
    return useful_s / wall_s


def goodput_fraction(
    interval_s: float, checkpoint_cost_s: float, mtbf_s: float, restart_s: float = 0.0
) -> float:
    """Fraction of wall time that advances training, to first order.

    Saving costs ``cost / (interval + cost)`` of every period; each failure (one
    per ``mtbf_s`` on average) costs the restart plus the lost work. Clamped at 0:
    a run that fails faster than it recovers makes no progress.
    """
    _positive("interval_s", interval_s)
    _non_negative("checkpoint_cost_s", checkpoint_cost_s)
    _positive("mtbf_s", mtbf_s)
    _non_negative("restart_s", restart_s)
    saving = interval_s / (interval_s + checkpoint_cost_s)
    failures = (restart_s + expected_lost_work_s(interval_s, checkpoint_cost_s)) / mtbf_s
    return max(0.0, saving * (1.0 - failures))


@dataclass(frozen=True)
class IntervalPlan:
    interval_s: float
    lost_work_per_failure_s: float
    goodput: float
    saves_per_hour: float


def plan_interval(checkpoint_cost_s: float, mtbf_s: float, restart_s: float = 0.0) -> IntervalPlan:
    """The Young/Daly interval and what it buys: the logic behind the notebook's widget."""
    interval = young_daly_interval_s(checkpoint_cost_s, mtbf_s)
    return IntervalPlan(
        interval_s=interval,
        lost_work_per_failure_s=expected_lost_work_s(interval, checkpoint_cost_s),
        goodput=goodput_fraction(interval, checkpoint_cost_s, mtbf_s, restart_s),
        saves_per_hour=3600.0 / (interval + checkpoint_cost_s),
    )


def restore_time_s(state_bytes: float, read_bytes_per_s: float, startup_s: float = 0.0) -> float:
    """A *model* for the restore-cache proposal, nothing implemented: restart time is
    start-up plus reading the state at the source's bandwidth (remote storage vs a
    peer's memory holding a replica)."""
    _positive("state_bytes", state_bytes)
    _positive("read_bytes_per_s", read_bytes_per_s)
    _non_negative("startup_s", startup_s)
    return startup_s + state_bytes / read_bytes_per_s


STORE_READ_BYTES_PER_S = 2e9
"""Assumed: a remote object store read at 2 GB/s by one restarting job."""
STARTUP_S = 60.0
"""Assumed: process start, imports and rendezvous of a restarted job."""


@dataclass(frozen=True)
class Scenario:
    """A fleet-scale case that a save cost measured here is scaled to (seconds, GB).

    One scenario for the widget, the figure and the restore model, so the same
    saver gets the same modelled goodput in all three. The defaults: a 100 GB
    state; the MTBF of about 3 h that the Llama 3 paper reports for unexpected
    interruptions on 16,384 H100s (their figure); a restart of :data:`STARTUP_S`
    plus reading the state back from a remote store at
    :data:`STORE_READ_BYTES_PER_S` (both assumed).
    """

    state_gb: float = 100.0
    mtbf_s: float = 3 * 3600.0
    restart_s: float = restore_time_s(100e9, STORE_READ_BYTES_PER_S, STARTUP_S)

    def plans(self, seconds_per_gb: dict[str, float]) -> dict[str, IntervalPlan]:
        """Per saver, :func:`plan_interval` at this scenario's state size, MTBF and restart."""
        return {name: plan_interval(s_per_gb * self.state_gb, self.mtbf_s, self.restart_s)
                for name, s_per_gb in seconds_per_gb.items()}


def plan_text(seconds_per_gb: dict[str, float], state_gb: float, mtbf_h: float, restart_s: float) -> str:
    """One line per saver: its checkpoint cost at ``state_gb`` and the plan :func:`plan_interval` makes of it."""
    scenario = Scenario(state_gb=state_gb, mtbf_s=mtbf_h * 3600, restart_s=restart_s)
    lines = []
    for name, plan in scenario.plans(seconds_per_gb).items():
        cost_s = seconds_per_gb[name] * state_gb
        lines.append(f"{name:>5}: cost {cost_s:7.1f} s -> save every {plan.interval_s / 60:6.1f} min, "
                     f"lose {plan.lost_work_per_failure_s / 60:5.1f} min per failure, modelled goodput {plan.goodput:.4f}")
    return "\n".join(lines)


def plan_widget(seconds_per_gb: dict[str, float], scenario: Scenario = Scenario()):
    """Controls over :func:`plan_text` for savers whose cost per GB was measured, starting at ``scenario``
    (see :mod:`labkit.widgets`)."""
    import ipywidgets as widgets

    from labkit.widgets import live

    controls = {
        "state_gb": widgets.FloatSlider(value=scenario.state_gb, min=1.0, max=2000.0, step=1.0, description="state GB"),
        "mtbf_h": widgets.FloatSlider(value=scenario.mtbf_s / 3600, min=0.5, max=24.0, step=0.5, description="MTBF h"),
        "restart_s": widgets.FloatSlider(value=scenario.restart_s, min=0.0, max=3600.0, step=10.0,
                                         description="restart s"),
    }
    return live(lambda **values: plan_text(seconds_per_gb, **values), controls)


def plot_saver_plans(seconds_per_gb: dict[str, float], colors: dict[str, str], scenario: Scenario = Scenario()):
    """Modelled goodput against the interval between saves, one curve per saver, its Young/Daly interval a dot."""
    from labkit import plots

    plans = scenario.plans(seconds_per_gb)
    costs = {name: s_per_gb * scenario.state_gb for name, s_per_gb in seconds_per_gb.items()}
    low_s = 0.5 * min(costs.values())
    grid = [low_s * (scenario.mtbf_s / low_s) ** (i / 80) for i in range(81)]
    fig, (ax,) = plots.figure(1)
    for name, cost_s in costs.items():
        xs = sorted(grid + [plans[name].interval_s])
        ax.plot([x / 60 for x in xs], [goodput_fraction(x, cost_s, scenario.mtbf_s, scenario.restart_s) for x in xs],
                color=colors[name], label=name)
        ax.plot(plans[name].interval_s / 60, plans[name].goodput, "o", color=colors[name])
    ax.set_xscale("log")
    ax.set_xlabel("minutes between saves")
    ax.set_ylabel("goodput (model)")
    ax.set_ylim(0, 1)
    ax.set_title(f"{scenario.state_gb:.0f} GB state, MTBF {scenario.mtbf_s / 3600:.1f} h, restart "
                 f"{scenario.restart_s:.0f} s: dots are the Young/Daly interval")
    ax.legend()
    fig.tight_layout()
    return fig


def simulate_goodput(
    interval_s: float, *, checkpoint_cost_s: float, restart_s: float, mtbf_s: float,
    work_s: float, seed: int = 0,
) -> float:
    """Monte-Carlo goodput of a run needing ``work_s`` of useful work (a simulation).

    Work is cut into segments of ``interval_s`` each followed by a save of
    ``checkpoint_cost_s``; failures arrive as a Poisson process with mean gap
    ``mtbf_s``. A failure inside a segment loses the time spent in it and costs
    ``restart_s``; the segment is retried. Per segment the failed tries are
    geometric, so over all segments they are one negative-binomial draw; the time
    lost in them is a sum of truncated exponentials, drawn from its normal limit
    (thousands of failures per run), so years of training simulate in microseconds.
    """
    for name, value in (("interval_s", interval_s), ("mtbf_s", mtbf_s), ("work_s", work_s)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    for name, value in (("checkpoint_cost_s", checkpoint_cost_s), ("restart_s", restart_s)):
        if not value >= 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    rng = np.random.default_rng(seed)
    segments = math.ceil(work_s / interval_s)
    period_s = interval_s + checkpoint_cost_s
    fail_p = -math.expm1(-period_s / mtbf_s)
    failed_tries = int(rng.negative_binomial(segments, 1 - fail_p)) if fail_p > 0 else 0
    tail = math.exp(-period_s / mtbf_s)
    lost_mean_s = mtbf_s - period_s * tail / fail_p
    lost_sq_s2 = (2 * mtbf_s**2 - tail * (period_s**2 + 2 * period_s * mtbf_s + 2 * mtbf_s**2)) / fail_p
    lost_sd_s = math.sqrt(max(lost_sq_s2 - lost_mean_s**2, 0.0))
    lost_s = max(0.0, rng.normal(failed_tries * lost_mean_s, math.sqrt(failed_tries) * lost_sd_s)) if failed_tries else 0.0
    wall_s = segments * period_s + failed_tries * restart_s + lost_s
    return segments * interval_s / wall_s


@dataclass(frozen=True)
class SweepPoint:
    """Goodput at ``factor`` times the Young/Daly interval: simulated failures beside the first-order model."""

    factor: float
    interval_s: float
    simulated_goodput: float
    model_goodput: float


def interval_sweep(
    *, checkpoint_cost_s: float, restart_s: float, mtbf_s: float, work_s: float,
    factors: Sequence[float] = (1 / 64, 1 / 16, 1 / 4, 1, 4, 16, 64), seed: int = 0,
) -> list[SweepPoint]:
    """Goodput at multiples of the Young/Daly interval: simulated and the first-order model."""
    optimum_s = young_daly_interval_s(checkpoint_cost_s, mtbf_s)
    return [
        SweepPoint(factor=f, interval_s=f * optimum_s,
                   simulated_goodput=simulate_goodput(f * optimum_s, checkpoint_cost_s=checkpoint_cost_s,
                                                      restart_s=restart_s, mtbf_s=mtbf_s, work_s=work_s, seed=seed),
                   model_goodput=goodput_fraction(f * optimum_s, checkpoint_cost_s, mtbf_s, restart_s))
        for f in factors
    ]


def plot_interval_sweep(sweep: list[SweepPoint], reference: tuple[str, float] | None = None):
    """Modelled goodput against the interval: the first-order model as a line, a Monte-Carlo of the same
    failure model as points. ``reference`` (label, goodput) draws a figure from elsewhere as a dotted line.

    The y-axis starts at 0.85 (lower if a point falls below), so differences of a
    fraction of a percent look as small as they are.
    """
    from labkit import plots

    fig, (ax,) = plots.figure(1)
    xs = [point.interval_s for point in sweep]
    ax.plot(xs, [point.model_goodput for point in sweep], "-", color=plots.BASELINE, lw=3, alpha=0.5,
            label="Young/Daly first-order model")
    ax.plot(xs, [point.simulated_goodput for point in sweep], "o", color=plots.FIX,
            label="failures drawn at random (Monte-Carlo, same model)")
    optimum = next(point.interval_s for point in sweep if point.factor == 1)
    ax.axvline(optimum, color=plots.GOOD, lw=1, label="sqrt(2 x cost x MTBF)")
    if reference is not None:
        ax.axhline(reference[1], color=plots.WARN, lw=1, ls=":", label=reference[0])
    lowest = min(min(p.model_goodput, p.simulated_goodput) for p in sweep)
    ax.set_ylim(min(0.85, lowest - 0.02), 1.0)
    ax.set_xscale("log")
    ax.set_xlabel("checkpoint interval (s of work)")
    ax.set_ylabel("goodput (modelled)")
    ax.set_title("modelled goodput vs checkpoint interval")
    ax.legend(loc="lower center", fontsize=8)
    fig.tight_layout()
    return fig
