"""Keep a training run going when its hardware fails: supervise, detect, cordon, resume.

A long run on many nodes *will* see failures (the Llama 3 paper reports 419
unexpected interruptions in 54 days on 16,384 GPUs, theirs). What decides whether
the run finishes is the loop around it: notice the failure, stop what is left of
the job, take the bad node out of service, put a spare in its place and restart
from the newest checkpoint that verifies -- then account for what the failure
cost. This module is that loop, :func:`supervise`, on real processes:

* it starts every rank of :func:`labkit.recovery_rank.train_rank` in its own
  process group, with the variables torchrun sets;
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
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections import deque
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from labkit import triage
from labkit.heartbeat import HeartbeatWatch, StragglerRule, exit_verdict, read_new, silence_verdict
from labkit.launcher import check_backend, free_port
from labkit.processes import killpg
from labkit.recovery_rank import (CAUSE_OF_FAULT, RESTART_VAR, RUN_ID_VAR, TORCHELASTIC_RESTART_VAR, Fault,
                                  validate_faults)
from labkit.recovery_report import Attempt, Detection, RunReport

RANK_MODULE = "labkit.recovery_rank"
"""What each rank runs (``python -m``), under this supervisor or under torchrun."""

# The lesson is the control plane (detect, restart, resume), which a GPU does not change,
# so every profile supervises gloo CPU ranks at the sizes measured on the CI box;
# ``supervise(backend="nccl")`` puts the same job on GPUs.
SIZES = {
    "ci": {"steps": 80, "features": 128, "hidden": 256, "batch_size": 64, "checkpoint_every": 10},
    "gpu": {"steps": 80, "features": 128, "hidden": 256, "batch_size": 64, "checkpoint_every": 10},
    "multi-gpu": {"steps": 80, "features": 128, "hidden": 256, "batch_size": 64, "checkpoint_every": 10},
}


class RecoveryError(RuntimeError):
    """The run cannot go on; ``rank_traceback`` is the failing rank's, where it reported one."""

    def __init__(self, message: str, rank_traceback: str | None = None):
        super().__init__(message)
        self.rank_traceback = rank_traceback


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL at once, no grace: a failed attempt's ranks hold nothing the next attempt needs."""
    killpg(proc.pid, signal.SIGKILL)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def leftover_processes(run_id: str) -> list[int]:
    """Live processes started for ``run_id`` (found by the variable every rank carries)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get(RUN_ID_VAR) == run_id and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


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
    ``straggler`` says when a slow rank counts as failed (:class:`labkit.heartbeat.StragglerRule`).

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
    steps = int(train_kwargs.get("steps", 80))
    check_backend(backend)
    if spares < 0:
        raise ValueError(f"spares must be >= 0, got {spares}")
    _check_devices_for_nodes(backend, world_size + spares)
    if heartbeat_timeout_s <= 0:
        raise ValueError(f"heartbeat_timeout_s must be > 0, got {heartbeat_timeout_s}")
    checkpoint_every = int(train_kwargs.get("checkpoint_every", 10))
    if checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
    plan = validate_faults(list(faults), world_size=world_size, steps=steps)
    max_restarts = len(plan) + spares if max_restarts is None else max_restarts
    if max_restarts < 0:
        raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")

    run_path = Path(run_dir)
    if run_path.exists() and any(run_path.iterdir()) and not (run_path / "attempt-000").exists():
        raise ValueError(f"run_dir {run_path} holds files that are not a previous run's; give an empty or new folder")
    shutil.rmtree(run_path, ignore_errors=True)
    run_path.mkdir(parents=True)
    run_id = uuid.uuid4().hex
    nodes = [f"node{i}" for i in range(world_size + spares)]
    assignment = list(range(world_size))
    standby = deque(range(world_size, world_size + spares))
    report = RunReport(run_path, world_size, plan, [], [], [], time.time(), 0.0)
    all_procs: list[subprocess.Popen] = []
    warm: deque[subprocess.Popen] = deque()
    judge = triage.RetryJudge()
    try:
        for attempt in range(max_restarts + 1):
            procs = _launch_attempt(run_path, run_id, attempt, assignment, nodes, plan, train_kwargs,
                                    warm if warm_standby else None, backend)
            all_procs += procs
            report.attempts.append(Attempt(attempt, tuple(nodes[n] for n in assignment), time.time(),
                                           tuple(p.pid for p in procs)))
            outcome = _watch_attempt(
                report, procs, attempt, heartbeat_timeout_s, startup_timeout_s, straggler, poll_s, progress,
                on_training=functools.partial(_refill_standby, warm, all_procs, world_size, run_path, run_id)
                if warm_standby else None,
            )
            for proc in procs:
                _kill_group(proc)
            if outcome is None:
                break
            _stop_if_no_node_can_help(report, attempt, outcome, judge)
            cause, rank, detail, _ = outcome
            failed_node = _record_detection(report, attempt, outcome, nodes[assignment[rank]])
            if not standby:
                raise RecoveryError(
                    f"{failed_node} (rank {rank}) failed ({cause}: {detail}) and no healthy spare is left; "
                    f"cordoned: {report.cordoned}. Give more spares="
                )
            assignment[rank] = standby.popleft()
        else:
            raise RecoveryError(f"gave up after max_restarts={max_restarts}; detections: {report.detections}")
    finally:
        for proc in all_procs:
            _kill_group(proc)
        for pid in leftover_processes(run_id):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        report.t_end = time.time()
        report.leftover_pids = leftover_processes(run_id)
    return report


def _record_detection(report: RunReport, attempt: int, outcome: tuple[str, int, str, float], node: str) -> str:
    """Note the failure (matched to the injected fault that explains it, if any) and cordon its node."""
    cause, rank, detail, t_detect = outcome
    fired = [r for r in report.records[attempt].get(rank, []) if r["event"] == "fault"]
    matched = next((r for r in fired if CAUSE_OF_FAULT[r["kind"]] == cause), None)
    report.detections.append(Detection(
        attempt, cause, rank, node, t_detect, detail,
        matched["fault_id"] if matched else None, matched["t"] if matched else None,
    ))
    report.cordoned.append(node)
    return node


def _stop_if_no_node_can_help(
    report: RunReport, attempt: int, outcome: tuple[str, int, str, float], judge: triage.RetryJudge
) -> None:
    """Raise RecoveryError, with the rank's traceback, for a failure a spare cannot fix."""
    cause, rank, _, _ = outcome
    errors = [r for r in report.records[attempt].get(rank, []) if r["event"] == "error"]
    error = errors[-1] if cause == "exit" and errors else None
    reason = judge.why_stop(cause, rank, error, report.attempts[attempt].t_first_step_end is not None)
    if reason is None:
        return
    log = report.run_dir / f"attempt-{attempt:03d}" / f"rank{rank}.log"
    shown = f"the rank's traceback:\n{error['traceback']}" if error else f"the rank's log is {log}"
    raise RecoveryError(f"attempt {attempt} stopped instead of retrying on a spare: {reason}. "
                        f"Fix it and rerun; {shown}", error["traceback"] if error else None)


def _start_standby(run_path: Path, run_id: str) -> subprocess.Popen:
    """A warm spare process: it imports torch and labkit now and waits for its orders on stdin."""
    folder = run_path / "standby"
    folder.mkdir(exist_ok=True)
    env = {**os.environ, RUN_ID_VAR: run_id, "LABKIT_SUPERVISOR_PID": str(os.getpid()), "OMP_NUM_THREADS": "1"}
    env.pop(TORCHELASTIC_RESTART_VAR, None)
    with open(folder / f"process-{uuid.uuid4().hex[:8]}.log", "w") as log:
        return subprocess.Popen([sys.executable, "-m", RANK_MODULE, "--standby"], env=env, stdin=subprocess.PIPE,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, text=True)


def _refill_standby(warm: deque, all_procs: list[subprocess.Popen], world_size: int, run_path: Path,
                    run_id: str) -> None:
    """Boot warm spares until there is one per rank (called once the attempt trains)."""
    while len(warm) < world_size:
        warm.append(_start_standby(run_path, run_id))
        all_procs.append(warm[-1])


def node_local_rank(node: int) -> int:
    """LOCAL_RANK (the GPU index) of the process on emulated node ``node``.

    The emulated nodes are slots of this one machine, one process each, and node
    ``i`` owns device ``i``. A spare that takes over rank ``r`` runs on the device of
    the slot it takes, not on rank ``r``'s: that one belongs to the cordoned node.
    """
    if node < 0:
        raise ValueError(f"node must be >= 0, got {node}")
    return node


def _check_devices_for_nodes(backend: str, nodes: int) -> None:
    """NCCL ranks need a GPU per node slot, spares included, before anything starts."""
    if backend != "nccl":
        return
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if nodes > gpus:
        raise ValueError(f"backend='nccl' puts each of world_size + spares = {nodes} node slots on a GPU of "
                         f"its own, and this machine has {gpus}; lower spares or world_size, or use "
                         f"backend='gloo'")


def _launch_attempt(
    run_path: Path, run_id: str, attempt: int, assignment: list[int], nodes: list[str],
    plan: list[Fault], train_kwargs: dict, warm: deque | None, backend: str,
) -> list[subprocess.Popen]:
    """Start (cold) or hand orders to (warm) one process per rank, with torchrun's variables."""
    from labkit import dsops

    dsops.use_environment_extensions_dir()
    attempt_dir = run_path / f"attempt-{attempt:03d}"
    attempt_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    kwargs = {**train_kwargs, "run_dir": str(run_path), "faults": [asdict(f) for f in plan]}
    world_size = len(assignment)
    procs = []
    for rank, node in enumerate(assignment):
        rank_env = {
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "RANK": str(rank), "LOCAL_RANK": str(node_local_rank(node)),
            "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
            "LABKIT_BACKEND": backend,
            "LABKIT_TIMEOUT_S": os.environ.get("LABKIT_TIMEOUT_S", "600"),
            "OMP_NUM_THREADS": "1", RESTART_VAR: str(attempt), RUN_ID_VAR: run_id,
            "LABKIT_NODE": nodes[node], "LABKIT_SUPERVISOR_PID": str(os.getpid()),
        }
        log_path = attempt_dir / f"rank{rank}.log"
        while warm:
            proc = warm.popleft()
            try:
                proc.stdin.write(json.dumps({"env": rank_env, "kwargs": kwargs, "log": str(log_path)}) + "\n")
                proc.stdin.close()
            except (BrokenPipeError, OSError):
                _kill_group(proc)
                continue
            procs.append(proc)
            break
        else:
            env = {**os.environ, **rank_env}
            env.pop(TORCHELASTIC_RESTART_VAR, None)
            with open(log_path, "w") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", RANK_MODULE, "--kwargs", json.dumps(kwargs)],
                    env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def _watch_attempt(
    report: RunReport, procs: list[subprocess.Popen], attempt: int, heartbeat_timeout_s: float,
    startup_timeout_s: float, straggler: StragglerRule, poll_s: float, progress: Any,
    on_training: Callable[[], None] | None = None,
) -> tuple[str, int, str, float] | None:
    """Poll until the attempt succeeds (None) or fails: (cause, blamed rank, detail, time).

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
            return "nonfinite", rank, f"loss {watch.nonfinite[rank]['loss']} at step {watch.nonfinite[rank]['step']}", now
        codes = [proc.poll() for proc in procs]
        if len(watch.done) == len(procs):
            _wait_for_exit(procs, grace_s=10.0)
            return None
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            drain()  # a NaN report may have landed just before the exit
            if watch.nonfinite:
                rank = min(watch.nonfinite)
                return "nonfinite", rank, f"loss {watch.nonfinite[rank]['loss']}", now
            return ("exit", *exit_verdict(failed, watch.errors), now)
        if watch.straggler is not None:
            return "straggler", watch.straggler[0], watch.straggler[1], now
        if watch.steps_seen and on_training is not None:
            on_training()
            on_training = None
        silence = silence_verdict(watch, len(procs), now, now - t_launch, heartbeat_timeout_s, startup_timeout_s)
        if silence is not None:
            return ("hang", *silence, now)
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
