"""What a supervised run reports: its attempts, what was detected, and where its wall time went.

:func:`labkit.recovery.supervise` fills a :class:`RunReport` from the ranks'
heartbeat records; :func:`breakdown` splits its wall time into useful steps, lost
work, restarts, checkpoints and the first start (goodput as defined once in
:func:`labkit.interval.goodput`), and :func:`model_beside_measured` puts the
Young/Daly model, fed with the same run's costs, beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

from labkit.fault_plan import Fault


@dataclass(frozen=True)
class Detection:
    """What the supervisor saw, and the injected fault it matches (if any)."""

    attempt: int
    cause: str
    rank: int
    node: str
    t_detect: float
    detail: str
    fault_id: str | None = None
    t_fault: float | None = None
    step: int | None = None
    """For a straggler, the last step of the window the rule judged slow; None for other causes."""


@dataclass(frozen=True)
class Attempt:
    index: int
    nodes: tuple[str, ...]
    t_launch: float
    pids: tuple[int, ...]
    restored_step: int | None = None
    t_first_step_end: float | None = None


@dataclass(frozen=True)
class GoodputBreakdown:
    """Where the wall-clock time of a run went (seconds)."""

    useful_s: float
    lost_work_s: float
    restart_s: float
    checkpoint_s: float
    startup_s: float
    other_s: float
    wall_s: float
    failures: int
    saves: int
    useful_steps: int
    redone_steps: int

    @property
    def goodput(self) -> float:
        """:func:`labkit.interval.goodput`: useful step time over the run's wall time."""
        from labkit.interval import goodput

        return goodput(self.useful_s, self.wall_s)

    def parts(self) -> dict[str, float]:
        return {"useful steps": self.useful_s, "lost work (redone)": self.lost_work_s,
                "restart": self.restart_s, "checkpoint": self.checkpoint_s,
                "first start": self.startup_s, "other": self.other_s}


@dataclass(frozen=True)
class DetectionRow:
    """One detection as the lab tabulates it: who was blamed, who replaced them, how long it all took."""

    attempt: int
    cause: str
    rank: int
    node_cordoned: str | None
    replaced_by: str | None
    fault_id: str | None
    detect_s: float | None
    recovery_s: float | None
    resumed_from_step: int | None


@dataclass(frozen=True)
class ModelBesideMeasured:
    """The Young/Daly model fed with one run's measured costs (seconds), beside what the run measured."""

    step_s: float
    interval_s: float
    checkpoint_cost_s: float
    mtbf_s: float
    restart_s: float
    young_daly_interval_s: float
    model_goodput: float
    measured_goodput: float
    model_lost_per_failure_s: float
    measured_lost_per_failure_s: float

    def describe(self) -> str:
        """One line per figure, the model's next to the measured one, so the pairs read side by side."""
        return "\n".join(f"{f.name:>30}: {getattr(self, f.name):.4g}" for f in fields(self))


@dataclass
class RunReport:
    run_dir: Path
    world_size: int
    faults: list[Fault]
    attempts: list[Attempt]
    detections: list[Detection]
    cordoned: list[str]
    t_start: float
    t_end: float
    records: dict[int, dict[int, list[dict]]] = field(repr=False, default_factory=dict)
    leftover_pids: list[int] = field(default_factory=list)

    @property
    def wall_s(self) -> float:
        return self.t_end - self.t_start

    @property
    def injected(self) -> list[str]:
        """Fault ids the ranks actually fired (from their own logs)."""
        return sorted({r["fault_id"] for per_rank in self.records.values() for recs in per_rank.values()
                       for r in recs if r["event"] == "fault"})

    def steps_to_detect(self, detection: Detection) -> int | None:
        """Steps the blamed rank finished from its fault's step until the detection (how long a
        straggler ran slow before the supervisor acted); None for a detection no fault explains."""
        fault = next((f for f in self.faults if f.fault_id == detection.fault_id), None)
        if fault is None:
            return None
        records = self.records.get(detection.attempt, {}).get(detection.rank, [])
        return sum(1 for r in records if r["event"] == "step" and r["step"] >= fault.step and r["t"] <= detection.t_detect)

    def steps_to_verdict(self, detection: Detection) -> int | None:
        """Slow steps the straggler rule needed: from its fault's step to the last step of the window it
        judged slow. The rule's own latency, in steps; :meth:`steps_to_detect` adds the supervisor's
        reaction (its poll, and any time the machine kept it from running). None for a detection that is
        not a straggler verdict or that no fault explains."""
        fault = next((f for f in self.faults if f.fault_id == detection.fault_id), None)
        if fault is None or detection.step is None:
            return None
        return detection.step - fault.step + 1

    def redone_steps(self, detection: Detection) -> int:
        """Steps the failed attempt had completed that the next one computed again (from its checkpoint on)."""
        nxt = self.next_attempt(detection)
        if nxt is None or nxt.restored_step is None:
            return 0
        done = {r["step"] for records in self.records.get(detection.attempt, {}).values()
                for r in records if r["event"] == "step"}
        return sum(1 for step in done if step >= nxt.restored_step)

    def next_attempt(self, detection: Detection) -> Attempt | None:
        """The relaunch that followed a detection, if there was one."""
        index = detection.attempt + 1
        return self.attempts[index] if index < len(self.attempts) else None

    @property
    def recovered(self) -> list[str]:
        """Injected faults that were detected as the right cause and followed by a completed step."""
        out = []
        for det in self.detections:
            nxt = self.next_attempt(det)
            if det.fault_id and nxt is not None and nxt.t_first_step_end is not None:
                out.append(det.fault_id)
        return sorted(out)

    @property
    def false_alarms(self) -> list[Detection]:
        return [d for d in self.detections if d.fault_id is None]

    def recovery_s(self, cause: str | None = None) -> list[float]:
        """Fault (or detection) to the next completed training step, per failure."""
        out = []
        for det in self.detections:
            if cause is not None and det.cause != cause:
                continue
            nxt = self.next_attempt(det)
            if nxt is not None and nxt.t_first_step_end is not None:
                out.append(nxt.t_first_step_end - (det.t_fault if det.t_fault is not None else det.t_detect))
        return out

    def detection_table(self) -> list[DetectionRow]:
        rows = []
        for det in self.detections:
            nxt = self.next_attempt(det)
            rows.append(DetectionRow(
                attempt=det.attempt, cause=det.cause, rank=det.rank,
                node_cordoned=det.node if det.node in self.cordoned else None,
                replaced_by=nxt.nodes[det.rank] if nxt and nxt.nodes[det.rank] != det.node else None, fault_id=det.fault_id,
                detect_s=round(det.t_detect - det.t_fault, 2) if det.t_fault else None,
                recovery_s=round(nxt.t_first_step_end - (det.t_fault or det.t_detect), 2)
                if nxt and nxt.t_first_step_end else None,
                resumed_from_step=nxt.restored_step if nxt else None,
            ))
        return rows


def breakdown(report: RunReport) -> GoodputBreakdown:
    """Split the run's wall time from rank 0's heartbeat records.

    A step completed more than once (redone after a failure) counts as useful only
    the last time; earlier runs of it are lost work. Restart overhead runs from
    the last record of a failed attempt to the first step of the next (detection,
    teardown, relaunch, restore). Checkpoint overhead is the time saves blocked.
    """
    completions: dict[int, list[float]] = {}
    checkpoint_s, saves, restart_s = 0.0, 0, 0.0
    startup_s, last_end = 0.0, report.t_start
    for attempt in report.attempts:
        steps = [r for r in report.records.get(attempt.index, {}).get(0, []) if r["event"] == "step"]
        if not steps:
            continue
        gap = steps[0]["t_start"] - last_end
        if attempt.index == 0 or last_end == report.t_start:
            startup_s += gap
        else:
            restart_s += gap
        for record in steps:
            completions.setdefault(record["step"], []).append(record["t_end"] - record["t_start"])
            checkpoint_s += record["checkpoint_s"]
            saves += record["checkpoint_s"] > 0
        last_end = steps[-1]["t_end"] + steps[-1]["checkpoint_s"]
    useful = sum(times[-1] for times in completions.values())
    lost = sum(sum(times[:-1]) for times in completions.values())
    wall = report.wall_s
    return GoodputBreakdown(
        useful_s=useful, lost_work_s=lost, restart_s=restart_s, checkpoint_s=checkpoint_s,
        startup_s=startup_s, other_s=wall - useful - lost - restart_s - checkpoint_s - startup_s,
        wall_s=wall, failures=len(report.detections), saves=saves, useful_steps=len(completions),
        redone_steps=sum(len(t) - 1 for t in completions.values()),
    )


def model_beside_measured(report: RunReport, breakdown: GoodputBreakdown, checkpoint_every: int) -> ModelBesideMeasured:
    """The Young/Daly model fed with this run's measured costs, beside what we measured.

    The model knows nothing of the first start and the final shutdown, so both
    sides are taken over the same window: the run minus those two.
    """
    from labkit.interval import goodput_fraction, young_daly_interval_s

    window_s = breakdown.wall_s - breakdown.startup_s - breakdown.other_s
    step_s = breakdown.useful_s / max(breakdown.useful_steps, 1)
    checkpoint_cost_s = breakdown.checkpoint_s / max(breakdown.saves, 1)
    failures = max(breakdown.failures, 1)
    mtbf_s = window_s / failures
    restart_s = breakdown.restart_s / failures
    interval_s = checkpoint_every * step_s
    return ModelBesideMeasured(
        step_s=step_s, interval_s=interval_s, checkpoint_cost_s=checkpoint_cost_s, mtbf_s=mtbf_s, restart_s=restart_s,
        young_daly_interval_s=young_daly_interval_s(max(checkpoint_cost_s, 1e-6), mtbf_s),
        model_goodput=goodput_fraction(interval_s, checkpoint_cost_s, mtbf_s, restart_s),
        measured_goodput=breakdown.useful_s / window_s,
        model_lost_per_failure_s=(interval_s + checkpoint_cost_s) / 2,
        measured_lost_per_failure_s=breakdown.lost_work_s / failures,
    )


LLAMA3_MTBF_S = 54 * 86400 / 419
"""Llama 3 405B on 16,384 H100s: 419 unexpected interruptions in 54 days, one about every 3.1 h (their figure)."""


@dataclass(frozen=True)
class RecoveryCosts:
    """What a failure cost one supervised run, as a mean over its failures, and what a save cost it (seconds).

    Measured from the supervisor's records and rank 0's heartbeats: ``detect_s`` from
    the fault to its detection, ``teardown_s`` from detection to the relaunch,
    ``relaunch_s`` from the relaunch to rank 0 ready (process start, imports,
    rendezvous) less ``reload_s`` (finding, verifying and loading the checkpoint),
    ``first_step_s`` from ready to the end of the first step; ``lost_work_s`` is the
    redone work per failure at this run's interval, ``checkpoint_cost_s`` the time a
    save blocked training.
    """

    failures: int
    detect_s: float
    teardown_s: float
    relaunch_s: float
    reload_s: float
    first_step_s: float
    lost_work_s: float
    checkpoint_cost_s: float

    @property
    def restart_s(self) -> float:
        """From a fault to the next completed step: everything a failure costs but the redone work."""
        return self.detect_s + self.teardown_s + self.relaunch_s + self.reload_s + self.first_step_s

    def at_mtbf(self, mtbf_s: float):
        """:func:`labkit.interval.plan_interval` with these costs at a failure every ``mtbf_s``: the Young/Daly
        interval and the goodput the first-order model gives there (work lost: half an interval per failure)."""
        from labkit.interval import plan_interval

        return plan_interval(max(self.checkpoint_cost_s, 1e-6), mtbf_s, self.restart_s)

    def describe(self) -> str:
        parts = {"detect": self.detect_s, "teardown": self.teardown_s, "relaunch": self.relaunch_s,
                 "reload": self.reload_s, "first step": self.first_step_s}
        return (f"per failure (mean of {self.failures}): " + ", ".join(f"{k} {v:.2f} s" for k, v in parts.items())
                + f" = restart {self.restart_s:.2f} s; redone work {self.lost_work_s:.2f} s; "
                f"a save blocked training {self.checkpoint_cost_s * 1e3:.1f} ms")


def recovery_costs(report: RunReport, breakdown: GoodputBreakdown) -> RecoveryCosts:
    """The measured :class:`RecoveryCosts` of ``report``: its failures that were followed by a completed step."""
    rows = []
    for det in report.detections:
        nxt = report.next_attempt(det)
        ready = [r for r in report.records.get(det.attempt + 1, {}).get(0, []) if r["event"] == "ready"]
        if nxt is None or nxt.t_first_step_end is None or not ready:
            continue
        t_fault = det.t_fault if det.t_fault is not None else det.t_detect
        reload_s = ready[0].get("restore_s", 0.0)
        rows.append((det.t_detect - t_fault, nxt.t_launch - det.t_detect, ready[0]["t"] - nxt.t_launch - reload_s,
                     reload_s, nxt.t_first_step_end - ready[0]["t"]))
    if not rows:
        raise ValueError("the run has no failure followed by a completed step: nothing to measure a recovery from")
    mean = [sum(column) / len(rows) for column in zip(*rows)]
    return RecoveryCosts(len(rows), *mean, lost_work_s=breakdown.lost_work_s / max(breakdown.failures, 1),
                         checkpoint_cost_s=breakdown.checkpoint_s / max(breakdown.saves, 1))


def plot_goodput(report: RunReport, breakdown: GoodputBreakdown):
    """Left: a timeline of the run by category, each failure marked where it was detected. Right: where the
    wall time went."""
    from labkit import plots

    fig, (timeline_ax, bar_ax) = plots.figure(2, width=14, height=3.8)
    colors = {"useful steps": plots.GOOD, "lost work (redone)": plots.WARN, "restart": plots.BASELINE,
              "checkpoint": plots.FIX, "first start": "#cccccc", "other": "#eeeeee"}
    spans = []
    seen: dict[int, int] = {}
    step_records = []
    for attempt in report.attempts:
        step_records += [r for r in report.records.get(attempt.index, {}).get(0, []) if r["event"] == "step"]
    final = {r["step"]: i for i, r in enumerate(step_records)}
    for i, r in enumerate(step_records):
        label = "useful steps" if final[r["step"]] == i else "lost work (redone)"
        spans.append((label, r["t_start"] - report.t_start, r["t_end"] - r["t_start"], colors[label]))
        if r["checkpoint_s"]:
            spans.append(("checkpoint", r["t_end"] - report.t_start, r["checkpoint_s"], colors["checkpoint"]))
        seen[r["step"]] = seen.get(r["step"], 0) + 1
    for det in report.detections:
        nxt = report.next_attempt(det)
        previous = [r for r in report.records[det.attempt].get(0, []) if r["event"] == "step"]
        begin = previous[-1]["t_end"] if previous else report.attempts[det.attempt].t_launch
        end = nxt.t_first_step_end if nxt and nxt.t_first_step_end else det.t_detect
        spans.append(("restart", begin - report.t_start, end - begin, colors["restart"]))
    plots.timeline(timeline_ax, spans, title="rank 0 over the run", xlabel="time since start (s)")
    for det in report.detections:
        timeline_ax.axvline(det.t_detect - report.t_start, color=plots.WARN, lw=0.8, ls=":")
        timeline_ax.annotate(f"detected: {det.cause}", (det.t_detect - report.t_start, -0.45), fontsize=8, color=plots.WARN)
    parts = breakdown.parts()
    plots.bars(bar_ax, list(parts), list(parts.values()), colors=[colors[k] for k in parts],
               fmt="{:.1f}", ylabel="seconds", title=f"where the wall time went (goodput {breakdown.goodput:.0%})")
    fig.tight_layout()
    return fig


def compute_times(report: RunReport) -> dict[int, dict[int, dict[int, float]]]:
    """attempt -> step -> rank -> compute seconds, from the ranks' heartbeat records."""
    found: dict[int, dict[int, dict[int, float]]] = {}
    for attempt, per_rank in report.records.items():
        for rank, records in per_rank.items():
            for r in records:
                if r["event"] == "step":
                    found.setdefault(attempt, {}).setdefault(r["step"], {})[rank] = r["compute_s"]
    return found

