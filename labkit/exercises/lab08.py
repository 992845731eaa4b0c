"""Lab 8's exercises: how long a hang goes unnoticed; a straggler rule, tested on real heartbeat records."""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Callable

from labkit import fault_plan, recovery
from labkit.exercises import Verdict, check_code, predict
from labkit.heartbeat import read_new
from labkit.recovery_report import RunReport

StragglerTest = Callable[[float, float], bool]
PATIENCE = 3
"""Steps running a rule must hold before the supervisor acts (as :class:`labkit.heartbeat.StragglerRule`)."""


def hang_detection(size: recovery.RecoverySizes, prediction, *, world_size: int, timeout_s: float = 2.0,
                   steps: int = 16) -> Verdict | None:
    """Exercise 8.1: seconds from a rank hanging to the supervisor noticing, at a ``timeout_s`` heartbeat timeout."""
    job = {**size.train_kwargs(), "steps": steps}
    hang = fault_plan.Fault("hang", rank=0, step=steps // 2)

    def measure() -> float:
        with tempfile.TemporaryDirectory(prefix="labkit-exercise-") as folder:
            report = recovery.supervise(Path(folder) / "run", world_size=world_size, spares=1, faults=[hang],
                                        heartbeat_timeout_s=timeout_s, **job)
        detection = next(d for d in report.detections if d.fault_id == hang.fault_id)
        return detection.t_detect - detection.t_fault

    return predict("8.1", prediction, what=f"the seconds before a hung rank is noticed, heartbeat timeout "
                   f"{timeout_s:g} s", measure=measure, context=(timeout_s,), tolerance=0.15, unit="s",
                   explain=lambda got: f"A hung rank writes nothing, so only the heartbeat's silence gives it away: "
                                       f"the supervisor waits out the {timeout_s:g} s timeout (plus a poll), "
                                       f"{got - timeout_s:+.2f} s here. An exit code is seen at once.")


def straggler_rule(report: RunReport, plan: list[fault_plan.Fault], answer) -> bool | None:
    """Exercise 8.2: ``is_slow(own_s, others_median_s)``, applied ``PATIENCE`` steps running as the supervisor
    does, must catch the straggler of the faulted run and nobody else, on its real heartbeat records."""
    straggle = next(f for f in plan if f.kind == "straggle")
    fired_in = next(d.attempt for d in report.detections if d.fault_id == straggle.fault_id)
    attempts = _compute_times(report.run_dir)

    def test(rule: StragglerTest) -> str | None:
        for attempt, per_step in attempts.items():
            streak: dict[int, int] = {}
            for step in sorted(per_step):
                times = per_step[step]
                for rank, own in times.items():
                    others = statistics.median(t for r, t in times.items() if r != rank)
                    streak[rank] = streak.get(rank, 0) + 1 if rule(own, others) else 0
                    straggling = attempt == fired_in and rank == straggle.rank and step >= straggle.step
                    if streak[rank] >= PATIENCE and not straggling:
                        return (f"it calls rank {rank} a straggler at step {step} of attempt {attempt} "
                                f"({own * 1e3:.1f} ms against {others * 1e3:.1f} ms): a false alarm restarts a "
                                "healthy run")
                    if straggling and step >= straggle.step + PATIENCE - 1 and streak[rank] < PATIENCE:
                        return (f"rank {rank} computed {own * 1e3:.0f} ms against {others * 1e3:.1f} ms from step "
                                f"{straggle.step} on, and the rule had not caught it by step {step}")
        return None

    return check_code("8.2", answer, what="a function is_slow(own_s, others_median_s) -> bool", test=test)


def _compute_times(run_dir: Path) -> dict[int, dict[int, dict[int, float]]]:
    """attempt -> step -> rank -> compute seconds, from every rank's heartbeat file."""
    found: dict[int, dict[int, dict[int, float]]] = {}
    for path in sorted(run_dir.glob("attempt-*/rank*.jsonl")):
        attempt, rank = int(path.parent.name.split("-")[1]), int(path.stem[len("rank"):])
        for record in read_new(path, {}):
            if record["event"] == "step":
                found.setdefault(attempt, {}).setdefault(record["step"], {})[rank] = record["compute_s"]
    return {a: {s: t for s, t in steps.items() if len(t) > 1} for a, steps in found.items()}
