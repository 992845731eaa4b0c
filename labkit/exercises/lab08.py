"""Lab 8's exercises: how long a hang goes unnoticed; a straggler rule, tested on real heartbeat records."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from labkit import fault_plan, recovery
from labkit.exercises import Verdict, check_code, predict
from labkit.heartbeat import HeartbeatWatch
from labkit.recovery_report import RunReport, compute_times
from labkit.stragglers import StragglerRule

StragglerTest = Callable[[list[float], list[float], float], bool]


def hang_detection(size: recovery.RecoverySizes, prediction, *, world_size: int, timeout_s: float = 2.0,
                   steps: int = 16) -> Verdict | None:
    """Exercise 8.1: seconds from a rank hanging to the supervisor noticing, at a ``timeout_s`` heartbeat timeout."""
    job = {**size.train_kwargs(), "steps": steps}
    hang = fault_plan.Fault("hang", rank=0, step=steps // 2)

    def measure() -> float:
        # No spare: the run stops once the hang is detected, which is all this times (a restart on a spare
        # would add a fresh pair of ranks, about 2 s here, and measure nothing more).
        with tempfile.TemporaryDirectory(prefix="labkit-exercise-") as folder:
            try:
                recovery.supervise(Path(folder) / "run", world_size=world_size, spares=0, faults=[hang],
                                   heartbeat_timeout_s=timeout_s, **job)
            except recovery.RecoveryError as stopped:
                report = stopped.report
            else:
                raise RuntimeError("the hang stopped nothing: with no spare, a detected hang ends the run")
        detection = next(d for d in report.detections if d.fault_id == hang.fault_id)
        return detection.t_detect - detection.t_fault

    return predict("8.1", prediction, what=f"the seconds before a hung rank is noticed, heartbeat timeout "
                   f"{timeout_s:g} s", measure=measure, context=(timeout_s,), tolerance=0.15, unit="s",
                   explain=lambda got: f"A hung rank writes nothing, so only the heartbeat's silence gives it away: "
                                       f"the supervisor waits out the {timeout_s:g} s timeout (plus a poll), "
                                       f"{got - timeout_s:+.2f} s here. An exit code is seen at once.")


def straggler_rule(reports: Sequence[RunReport], fault: fault_plan.Fault, rule: StragglerRule, answer) -> bool | None:
    """Exercise 8.2: ``is_slow(own_s, others_s, factor)``, given every full window of a rank's compute times,
    the other ranks' median at the same steps in ``reports``' real heartbeat records and ``rule``'s threshold
    (calibrated on this machine), must catch ``fault``'s straggler before its attempt ended and call no
    healthy rank slow."""
    def test(is_slow: StragglerTest) -> str | None:
        learners = _LearnersRule(factor=rule.factor, window=rule.window, warmup=rule.warmup, test=is_slow)
        for report in reports:
            fired_in = next((d.attempt for d in report.detections if d.fault_id == fault.fault_id), None)
            for attempt, per_step in compute_times(report).items():
                problem = _replay(learners, per_step, fault if attempt == fired_in else None, attempt)
                if problem:
                    return problem
        return None

    return check_code("8.2", answer, what="a function is_slow(own_s, others_s, factor) -> bool", test=test)


@dataclass(frozen=True)
class _LearnersRule(StragglerRule):
    """The supervisor's rule with the learner's test in place of its own."""

    test: StragglerTest | None = None

    def is_slow(self, own_s, others_s) -> bool:
        return len(own_s) >= self.window and bool(self.test(list(own_s)[-self.window:], list(others_s)[-self.window:],
                                                            self.factor))


def _replay(rule: StragglerRule, per_step: dict[int, dict[int, float]], fault: fault_plan.Fault | None,
            attempt: int) -> str | None:
    """Why ``rule``, in the supervisor's own :class:`HeartbeatWatch` fed one attempt's records, fails: a
    false alarm, or ``fault``'s straggler never caught; None when it passes."""
    watch = HeartbeatWatch(rule)
    for rank in sorted({r for times in per_step.values() for r in times}):
        watch.feed(rank, {"event": "ready", "t": 0.0})
    for step in sorted(per_step):
        for rank, compute_s in per_step[step].items():
            watch.feed(rank, {"event": "step", "t": 0.0, "step": step, "compute_s": compute_s})
        if watch.straggler is not None:
            rank, detail, _ = watch.straggler
            if fault is not None and rank == fault.rank and step >= fault.step:
                return None
            return (f"it calls rank {rank} a straggler at step {step} of attempt {attempt}, a healthy rank ({detail}): "
                    "a false alarm restarts a healthy run")
    if fault is not None:
        return f"rank {fault.rank} ran slow from step {fault.step} on, and the rule never caught it"
    return None
