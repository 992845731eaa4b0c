"""Keep a training run going when its hardware fails: supervise, detect, cordon, resume.

A long run on many nodes *will* see failures (the Llama 3 paper reports 419
unexpected interruptions in 54 days on 16,384 GPUs, theirs). What decides whether
the run finishes is the loop around it: notice the failure, stop what is left of
the job, take the bad node out of service, put a spare in its place and restart
from the newest checkpoint that verifies -- then account for what the failure
cost. This module is that loop, :func:`supervise`, on real processes:

* it starts every rank of :func:`labkit.recovery_rank.train_rank` in its own
  process group, with the variables torchrun sets (:mod:`labkit.recovery_launch`);
* it watches exit codes, heartbeats, step-time outliers and non-finite losses
  (:mod:`labkit.heartbeat`), and on a failure kills the remaining ranks, cordons
  the node, swaps in a spare and relaunches. A failure no node could fix (a typo
  in the arguments, an unloadable checkpoint) stops the run with the rank's
  traceback instead (:mod:`labkit.triage`). It never leaves a process behind;
* it returns a :class:`labkit.recovery_report.RunReport`, whose
  :func:`~labkit.recovery_report.breakdown` says where the wall time went.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

from labkit import triage
from labkit.heartbeat import HeartbeatWatch, exit_verdict, read_new, silence_verdict
from labkit.stragglers import StragglerRule
from labkit.launcher import check_backend, rendezvous_store
from labkit.profiles import require_at_least
from labkit.recovery_launch import (check_devices_for_nodes, kill_rank, launch_attempt, leftover_processes,
                                    refill_standby)
from labkit.fault_plan import CAUSE_OF_FAULT, Fault, validate_faults
from labkit.recovery_report import Attempt, Detection, RunReport

@dataclass(frozen=True)
class RecoverySizes:
    """The supervised job: ``steps`` of an MLP ``features`` -> ``hidden``, saved every ``checkpoint_every`` steps."""

    steps: int
    features: int
    hidden: int
    batch_size: int
    checkpoint_every: int

    def __post_init__(self) -> None:
        require_at_least(self, 1, "steps", "features", "hidden", "batch_size", "checkpoint_every")

    def train_kwargs(self) -> dict[str, int]:
        """The keyword arguments :func:`supervise` passes on to every rank."""
        return asdict(self)


# The lesson is the control plane (detect, restart, resume), which a GPU does not change,
# so every profile supervises gloo CPU ranks at the sizes measured on the CI box;
# ``supervise(backend="nccl")`` puts the same job on GPUs. A batch of 1024 makes a step's compute
# 7-8 ms: at 64 (0.8 ms) fixed per-step overheads made healthy ranks' compute differ by 1.3x over
# 7 steps, which would hide a straggler.
SIZES = {
    "ci": RecoverySizes(steps=80, features=128, hidden=256, batch_size=1024, checkpoint_every=10),
    "gpu": RecoverySizes(steps=80, features=128, hidden=256, batch_size=1024, checkpoint_every=10),
    "multi-gpu": RecoverySizes(steps=80, features=128, hidden=256, batch_size=1024, checkpoint_every=10),
}

STORE_TIMEOUT_S = 600.0
"""How long the supervisor's store waits on a key; the ranks' own timeout is ``LABKIT_TIMEOUT_S``."""


class RecoveryError(RuntimeError):
    """The run cannot go on; ``rank_traceback`` is the failing rank's, where it reported one, and ``report``
    what the run measured up to there (its detections among it), where the supervisor had started it."""

    def __init__(self, message: str, rank_traceback: str | None = None):
        super().__init__(message)
        self.rank_traceback = rank_traceback
        self.report: RunReport | None = None   # set by supervise() as the error leaves it


def supervise(
    run_dir: str | Path,
    *,
    world_size: int = 2,
    spares: int = 2,
    faults: Sequence[Fault] = (),
    max_restarts: int | None = None,
    heartbeat_timeout_s: float = 5.0,
    startup_timeout_s: float = 120.0,
    straggler: StragglerRule = StragglerRule(),
    poll_s: float = 0.02,
    warm_standby: bool = False,
    progress: Any = None,
    backend: str = "gloo",
    **train_kwargs: Any,
) -> RunReport:
    """Run :func:`labkit.recovery_rank.train_rank` on ``world_size`` ranks until it finishes, recovering from failures.

    ``spares`` extra node slots stand by; each failure cordons the failed rank's
    node and moves that rank to a spare. ``run_dir`` (checkpoints, heartbeats,
    rank logs) is wiped first if it holds a previous run and refused if it holds
    anything else. ``progress`` is an optional tqdm bar advanced per step of rank 0.
    ``straggler`` says when a slow rank counts as failed (:class:`labkit.stragglers.StragglerRule`).

    A hang is recovered wherever it strikes: ranks have ``startup_timeout_s`` to
    report ready, then ``heartbeat_timeout_s`` of silence means a hang, first step
    included. A failure no spare can fix -- an exception from the program itself,
    or the same failure before a first step on two nodes in a row -- raises
    :class:`RecoveryError` carrying the rank's traceback (:mod:`labkit.triage`).

    ``warm_standby=True`` boots ``world_size`` spare *processes* (torch imported,
    waiting for orders) once an attempt is training, so a relaunch can skip process
    start and imports -- the bulk of a restart here. It only pays when failures are
    further apart than a process takes to boot and there are idle cores to boot it
    on; on the 2-core CI box neither holds, so the default is the baseline: every
    relaunch starts cold, as torchrun does.
    """
    plan, max_restarts = _checked_plan(world_size, spares, faults, max_restarts, heartbeat_timeout_s, backend,
                                       train_kwargs)
    run_path = fresh_run_dir(Path(run_dir))
    run_id = uuid.uuid4().hex
    report = RunReport(run_path, world_size, plan, [], [], [], time.time(), 0.0)
    all_procs: list[subprocess.Popen] = []
    store = rendezvous_store(STORE_TIMEOUT_S)   # every attempt's ranks meet here, each under its own prefix
    try:
        _run_attempts(report, run_id, all_procs, spares=spares, max_restarts=max_restarts,
                      heartbeat_timeout_s=heartbeat_timeout_s, startup_timeout_s=startup_timeout_s,
                      straggler=straggler, poll_s=poll_s, warm_standby=warm_standby, progress=progress,
                      backend=backend, train_kwargs=train_kwargs, store_port=store.port)
    except RecoveryError as stopped:
        stopped.report = report
        raise
    finally:
        _end_run(report, all_procs, run_id)
        del store   # closes its port now, even while a traceback keeps this frame
    return report


def _checked_plan(
    world_size: int, spares: int, faults: Sequence[Fault], max_restarts: int | None, heartbeat_timeout_s: float,
    backend: str, train_kwargs: dict[str, Any],
) -> tuple[list[Fault], int]:
    """The validated fault plan and restart budget; refuses a bad argument before any rank starts.

    By default every planned fault and every spare may cost one restart.
    """
    steps = int(train_kwargs.get("steps", 80))
    check_backend(backend)
    if spares < 0:
        raise ValueError(f"spares must be >= 0, got {spares}")
    check_devices_for_nodes(backend, world_size + spares)
    if heartbeat_timeout_s <= 0:
        raise ValueError(f"heartbeat_timeout_s must be > 0, got {heartbeat_timeout_s}")
    checkpoint_every = int(train_kwargs.get("checkpoint_every", 10))
    if checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
    plan = validate_faults(list(faults), world_size=world_size, steps=steps)
    max_restarts = len(plan) + spares if max_restarts is None else max_restarts
    if max_restarts < 0:
        raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
    return plan, max_restarts


def fresh_run_dir(run_path: Path) -> Path:
    """Empty ``run_path`` for a new run; only a previous run's folder may be wiped, never someone's files."""
    if run_path.exists() and any(run_path.iterdir()) and not (run_path / "attempt-000").exists():
        raise ValueError(f"run_dir {run_path} holds files that are not a previous run's; give an empty or new folder")
    shutil.rmtree(run_path, ignore_errors=True)
    run_path.mkdir(parents=True)
    return run_path


class Outcome(NamedTuple):
    """What ended an attempt: the cause, the blamed rank, why, when the supervisor saw it, and, for a
    straggler, the last step the rule's verdict judged (the supervisor acts a poll or more later)."""

    cause: str
    rank: int
    detail: str
    t: float
    step: int | None = None


def _run_attempts(
    report: RunReport, run_id: str, all_procs: list[subprocess.Popen], *, spares: int, max_restarts: int,
    heartbeat_timeout_s: float, startup_timeout_s: float, straggler: StragglerRule, poll_s: float,
    warm_standby: bool, progress: Any, backend: str, train_kwargs: dict[str, Any], store_port: int,
) -> None:
    """Launch, watch, and on each failure cordon the node and move its rank to a spare, until a clean finish.

    Every process started goes into ``all_procs``, so the caller can kill them all whatever happens here.
    """
    world_size, run_path = report.world_size, report.run_dir
    nodes = [f"node{i}" for i in range(world_size + spares)]
    assignment = list(range(world_size))
    standby = deque(range(world_size, world_size + spares))
    warm: deque[subprocess.Popen] = deque()
    judge = triage.RetryJudge()
    for attempt in range(max_restarts + 1):
        procs = launch_attempt(run_path, run_id, attempt, assignment, nodes, report.faults, train_kwargs,
                                warm if warm_standby else None, backend, store_port)
        all_procs += procs
        report.attempts.append(Attempt(attempt, tuple(nodes[n] for n in assignment), time.time(),
                                       tuple(p.pid for p in procs)))
        outcome = _watch_attempt(
            report, procs, attempt, heartbeat_timeout_s, startup_timeout_s, straggler, poll_s, progress,
            on_training=functools.partial(refill_standby, warm, all_procs, world_size, run_path, run_id)
            if warm_standby else None,
        )
        for proc in procs:
            kill_rank(proc)
        if outcome is None:
            return
        _stop_if_no_node_can_help(report, attempt, outcome, judge)
        cause, rank, detail = outcome.cause, outcome.rank, outcome.detail
        failed_node = _record_detection(report, attempt, outcome, nodes[assignment[rank]])
        if not triage.node_at_fault(cause):
            continue
        if not standby:
            raise RecoveryError(
                f"{failed_node} (rank {rank}) failed ({cause}: {detail}) and no healthy spare is left; "
                f"cordoned: {report.cordoned}. Give more spares="
            )
        assignment[rank] = standby.popleft()
    raise RecoveryError(f"gave up after max_restarts={max_restarts}; detections: {report.detections}")


def _end_run(report: RunReport, all_procs: list[subprocess.Popen], run_id: str) -> None:
    """Kill every process the run started, then any stray that still carries its run id, and stamp the end."""
    for proc in all_procs:
        kill_rank(proc)
    for pid in leftover_processes(run_id):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    report.t_end = time.time()
    report.leftover_pids = leftover_processes(run_id)


def _record_detection(report: RunReport, attempt: int, outcome: Outcome, node: str) -> str:
    """Note the failure (matched to the injected fault that explains it, if any) and cordon its node if a
    fresh node could help (:func:`labkit.triage.node_at_fault`)."""
    cause, rank, detail, t_detect, step = outcome
    fired = [r for r in report.records[attempt].get(rank, []) if r["event"] == "fault"]
    matched = next((r for r in fired if CAUSE_OF_FAULT[r["kind"]] == cause), None)
    report.detections.append(Detection(
        attempt, cause, rank, node, t_detect, detail,
        matched["fault_id"] if matched else None, matched["t"] if matched else None, step,
    ))
    if triage.node_at_fault(cause):
        report.cordoned.append(node)
    return node


def _stop_if_no_node_can_help(
    report: RunReport, attempt: int, outcome: Outcome, judge: triage.RetryJudge
) -> None:
    """Raise RecoveryError, with the rank's traceback, for a failure a spare cannot fix."""
    cause, rank = outcome.cause, outcome.rank
    errors = [r for r in report.records[attempt].get(rank, []) if r["event"] == "error"]
    error = errors[-1] if cause == "exit" and errors else None
    reason = judge.why_stop(cause, rank, error, report.attempts[attempt].t_first_step_end is not None)
    if reason is None:
        return
    log = report.run_dir / f"attempt-{attempt:03d}" / f"rank{rank}.log"
    shown = f"the rank's traceback:\n{error['traceback']}" if error else f"the rank's log is {log}"
    raise RecoveryError(f"attempt {attempt} stopped instead of retrying on a spare: {reason}. "
                        f"Fix it and rerun; {shown}", error["traceback"] if error else None)


def _watch_attempt(
    report: RunReport, procs: list[subprocess.Popen], attempt: int, heartbeat_timeout_s: float,
    startup_timeout_s: float, straggler: StragglerRule, poll_s: float, progress: Any,
    on_training: Callable[[], None] | None = None,
) -> Outcome | None:
    """Poll until the attempt succeeds (None) or fails (:class:`Outcome`).

    ``on_training`` runs once, after the first step: warm spares boot while the job
    trains rather than competing with its restart.
    """
    attempt_dir = report.run_dir / f"attempt-{attempt:03d}"
    records: dict[int, list[dict]] = {rank: [] for rank in range(len(procs))}
    report.records[attempt] = records
    offsets: dict[Path, int] = {}
    watch = HeartbeatWatch(straggler)
    drain = functools.partial(_drain, report, attempt, attempt_dir, offsets, watch, progress)
    t_launch = time.time()
    while True:
        drain()
        now = time.time()
        if watch.nonfinite:
            rank = min(watch.nonfinite)
            return Outcome("nonfinite", rank, f"loss {watch.nonfinite[rank]['loss']} at step {watch.nonfinite[rank]['step']}", now)
        codes = [proc.poll() for proc in procs]
        if len(watch.done) == len(procs):
            _wait_for_exit(procs, grace_s=10.0)
            return None
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            drain()  # a NaN report may have landed just before the exit
            if watch.nonfinite:
                rank = min(watch.nonfinite)
                return Outcome("nonfinite", rank, f"loss {watch.nonfinite[rank]['loss']}", now)
            return Outcome("exit", *exit_verdict(failed, watch.errors), now)
        if watch.straggler is not None:
            return Outcome("straggler", *watch.straggler[:2], now, step=watch.straggler[2])
        if watch.steps_seen and on_training is not None:
            on_training()
            on_training = None
        silence = silence_verdict(watch, len(procs), now, now - t_launch, heartbeat_timeout_s, startup_timeout_s)
        if silence is not None:
            return Outcome("hang", *silence, now)
        time.sleep(poll_s)


def _drain(report: RunReport, attempt: int, attempt_dir: Path, offsets: dict[Path, int], watch: HeartbeatWatch,
           progress: Any) -> None:
    """Read every rank's new heartbeat records into the report, the watch and the progress bar."""
    for rank, records in report.records[attempt].items():
        for record in read_new(attempt_dir / f"rank{rank}.jsonl", offsets):
            records.append(record)
            watch.feed(rank, record)
            _note_attempt_progress(report, attempt, rank, record, progress)


def _wait_for_exit(procs: list[subprocess.Popen], grace_s: float) -> None:
    """Ranks that logged "done" have committed their work; give them a moment to exit cleanly."""
    deadline = time.time() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            return


def _note_attempt_progress(report: RunReport, attempt: int, rank: int, record: dict, progress: Any) -> None:
    current = report.attempts[attempt]
    if record["event"] == "ready" and current.restored_step is None:
        report.attempts[attempt] = current = replace(current, restored_step=record["restored_step"])
    if record["event"] == "step":
        if current.t_first_step_end is None:
            report.attempts[attempt] = replace(current, t_first_step_end=record["t_end"])
        if rank == 0 and progress is not None:
            progress.n = record["step"] + 1
            progress.refresh()
