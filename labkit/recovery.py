"""Keep a training run going when its hardware fails: supervise, detect, cordon, resume.

A long run on many nodes *will* see failures (the Llama 3 paper reports 419
unexpected interruptions in 54 days on 16,384 GPUs, theirs). What decides whether
the run finishes is the loop around it: notice the failure, stop what is left of
the job, take the bad node out of service, put a spare in its place and restart
from the newest checkpoint that verifies -- then account for what the failure
cost. This module is that loop, on real processes:

* :func:`train_rank` -- the training job: real ``torch.distributed`` ranks (gloo on
  the CPU, nccl on GPUs) training a small MLP with an explicit gradient
  all-reduce and checkpointing with Lab 7's savers. It logs a heartbeat record
  per phase of every step and injects the faults it is told to (really: SIGKILL
  of its own process, a sleep that never ends, a slow node, a NaN loss).
* :func:`supervise` -- the supervisor: starts every rank in its own process
  group, watches exit codes, heartbeats, step-time outliers and non-finite
  losses, and on a failure kills the remaining ranks, cordons the node, swaps in
  a spare and relaunches. A failure no node could fix (a typo in the arguments,
  an unloadable checkpoint) stops the run with the rank's traceback instead
  (:mod:`labkit.triage`). It never leaves a process behind.
* :func:`goodput` -- useful steps vs lost work vs restart vs checkpoint overhead,
  beside the Young/Daly model (:mod:`labkit.interval`).

The supervisor starts each rank as ``python -m labkit.recovery`` with the
variables torchrun sets, so the same entry point runs under torchrun's own
restart loop on a real cluster (``run_dir`` on a shared file system)::

    torchrun --nnodes 2 --nproc-per-node 8 --max-restarts 3 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29400 -m labkit.recovery \\
        --kwargs '{"run_dir": "/shared/run1", "steps": 1000}'

torchrun restarts every worker after any exit and sets TORCHELASTIC_RESTART_COUNT,
which the rank reads; it does not cordon nodes or watch heartbeats and
stragglers -- that is what the supervisor here adds (a hung collective there ends
at the process-group timeout, ``LABKIT_TIMEOUT_S``). The entry point keys its
rendezvous by restart count: with torch 2.13 a restarted gloo group otherwise
read the previous attempt's peer addresses from torchrun's store and failed.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from labkit import triage
from labkit.launcher import check_backend, free_port

FAULT_KINDS = ("kill", "hang", "straggle", "nan")
CAUSE_OF_FAULT = {"kill": "exit", "hang": "hang", "straggle": "straggler", "nan": "nonfinite"}
RUN_ID_VAR = "LABKIT_RUN_ID"
RESTART_VAR = "LABKIT_RESTART_COUNT"
TORCHELASTIC_RESTART_VAR = "TORCHELASTIC_RESTART_COUNT"

# The lesson is the control plane (detect, restart, resume), which a GPU does not change,
# so every profile supervises gloo CPU ranks at the sizes measured on the CI box;
# ``supervise(backend="nccl")`` puts the same job on GPUs.
SIZES = {
    "ci": {"steps": 80, "features": 128, "hidden": 256, "batch_size": 64, "checkpoint_every": 10},
    "gpu": {"steps": 80, "features": 128, "hidden": 256, "batch_size": 64, "checkpoint_every": 10},
    "multi-gpu": {"steps": 80, "features": 128, "hidden": 256, "batch_size": 64, "checkpoint_every": 10},
}


@dataclass(frozen=True)
class Fault:
    """One fault to inject: ``kind`` on ``rank`` when it is about to run ``step``."""

    kind: str
    rank: int
    step: int

    @property
    def fault_id(self) -> str:
        return f"{self.kind}-rank{self.rank}-step{self.step}"


def validate_faults(faults: Sequence[Fault], *, world_size: int, steps: int) -> list[Fault]:
    """Reject plans that could never fire, before any rank starts."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    seen_steps: set[int] = set()
    checked = []
    for fault in faults:
        if fault.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {FAULT_KINDS}, got {fault.kind!r}")
        if not 0 <= fault.rank < world_size:
            raise ValueError(f"fault {fault.fault_id}: rank must be in [0, {world_size - 1}], got {fault.rank}")
        if not 0 <= fault.step < steps:
            raise ValueError(f"fault {fault.fault_id}: step must be in [0, {steps - 1}], got {fault.step}")
        if fault.step in seen_steps:
            raise ValueError(f"fault {fault.fault_id}: two faults at step {fault.step}; give each fault its own step")
        seen_steps.add(fault.step)
        checked.append(fault)
    return sorted(checked, key=lambda f: f.step)


def random_fault_plan(
    kinds: Sequence[str], *, world_size: int, steps: int, seed: int, min_gap_steps: int = 8
) -> list[Fault]:
    """One fault of each kind at random ranks and steps (deterministic given ``seed``),
    at least ``min_gap_steps`` apart so each failure is recovered before the next."""
    rng = np.random.default_rng(seed)
    span = steps - min_gap_steps * (len(kinds) + 1)
    if span < 0:
        raise ValueError(
            f"steps must be >= {min_gap_steps * (len(kinds) + 1)} for {len(kinds)} faults "
            f"{min_gap_steps} steps apart, got {steps}"
        )
    offsets = np.sort(rng.integers(0, span + 1, len(kinds)))
    faults = [
        Fault(kind, int(rng.integers(0, world_size)), int(min_gap_steps * (i + 1) + offsets[i]))
        for i, kind in enumerate(kinds)
    ]
    return validate_faults(faults, world_size=world_size, steps=steps)


def restart_count() -> int:
    """Which attempt this is: torchrun's count where present, else the supervisor's."""
    return int(os.environ.get(TORCHELASTIC_RESTART_VAR, os.environ.get(RESTART_VAR, 0)))


class _EventLog:
    """Heartbeat records, one JSON line each, flushed at once so a watcher sees them."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = open(path, "a", buffering=1)

    def write(self, event: str, **fields: Any) -> None:
        self._handle.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")


def _fault_marker(run_dir: Path, fault: Fault) -> Path:
    return run_dir / "faults" / fault.fault_id


def _watch_parent() -> None:
    """Exit if the supervisor that started us disappears: no orphans even if it is SIGKILLed."""
    parent = int(os.environ.get("LABKIT_SUPERVISOR_PID", 0))
    if not parent:
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="labkit-parent-watch").start()


def make_model(features: int, hidden: int, classes: int = 10):
    import torch

    return torch.nn.Sequential(
        torch.nn.Linear(features, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, classes),
    )


def make_batch(step: int, rank: int, *, seed: int, batch_size: int, features: int, classes: int = 10):
    """The batch for (step, rank) depends on nothing else, so a resumed run sees the same data."""
    import torch

    generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    x = torch.randn(batch_size, features, generator=generator)
    y = torch.randint(0, classes, (batch_size,), generator=generator)
    return x, y


def train_rank(
    run_dir: str,
    steps: int = 80,
    features: int = 256,
    hidden: int = 512,
    batch_size: int = 128,
    lr: float = 0.05,
    seed: int = 0,
    checkpoint_every: int = 10,
    saver: str = "async",
    straggle_extra_s: float = 0.4,
    faults: Sequence[dict] = (),
) -> dict:
    """One rank of the supervised job; resumes from the newest verified checkpoint.

    A committed checkpoint that will not load raises (:func:`labkit.checkpoint.load_for_resume`)
    rather than quietly starting again from step 0.

    Data-parallel SGD with momentum: every rank computes gradients on its own
    batch, one all-reduce averages them, rank 0 saves. Checkpoint ``k`` holds the
    state after ``k`` steps (``loader_position=k``).
    """
    import torch
    import torch.distributed as dist

    from labkit.checkpoint import AsyncSaver, SyncSaver, capture_training_state, load_for_resume, restore_training_state

    if saver not in ("async", "sync"):
        raise ValueError(f"saver must be 'async' or 'sync', got {saver!r}")
    _watch_parent()
    run_path = Path(run_dir)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    attempt = restart_count()
    log = _EventLog(run_path / f"attempt-{attempt:03d}" / f"rank{rank}.jsonl")
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if dist.get_backend() == "nccl" else "cpu")

    torch.manual_seed(seed)
    model = make_model(features, hidden).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    latest = load_for_resume(run_path / "checkpoints")
    start_step = restore_training_state(latest.state, model, optimizer) if latest else 0
    agreed = torch.tensor([start_step, -start_step], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    if agreed[0].item() != -agreed[1].item():
        raise RuntimeError(f"ranks restored different checkpoints (steps {-agreed[1].item()}..{agreed[0].item()})")
    checkpointer = (AsyncSaver if saver == "async" else SyncSaver)(run_path / "checkpoints", keep=3) if rank == 0 else None
    log.write("ready", restored_step=start_step, pid=os.getpid(), node=os.environ.get("LABKIT_NODE", ""))

    mine = {
        f.step: f for f in (Fault(**d) for d in faults)
        if f.rank == rank and not _fault_marker(run_path, f).exists()
    }
    params = list(model.parameters())
    straggling = False
    for step in range(start_step, steps):
        t_start = time.time()
        fault = mine.get(step)
        if fault is not None:
            _fault_marker(run_path, fault).parent.mkdir(parents=True, exist_ok=True)
            _fault_marker(run_path, fault).touch()
            log.write("fault", kind=fault.kind, step=step, fault_id=fault.fault_id)
            if fault.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault.kind == "hang":
                while True:
                    time.sleep(3600)
            straggling = straggling or fault.kind == "straggle"
        x, y = make_batch(step, rank, seed=seed, batch_size=batch_size, features=features)
        loss = torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        if fault is not None and fault.kind == "nan":
            loss = loss * float("nan")
        loss_value = loss.item()
        if not math.isfinite(loss_value):
            log.write("nonfinite", step=step, loss=loss_value)
            raise FloatingPointError(f"rank {rank}: loss is {loss_value} at step {step}; stopping before it reaches the weights")
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        if straggling:
            time.sleep(straggle_extra_s)
        t_computed = time.time()
        log.write("computed", step=step)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        flat /= world_size
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset: offset + p.numel()].view_as(p.grad))
            offset += p.numel()
        optimizer.step()
        t_end = time.time()
        checkpoint_s = 0.0
        done = step + 1
        if checkpointer is not None and (done % checkpoint_every == 0 or done == steps):
            state = capture_training_state(model, optimizer, loader_position=done)
            checkpoint_s = checkpointer.save(done, state).blocked_s
        log.write("step", step=step, t_start=t_start, t_end=t_end, compute_s=t_computed - t_start,
                  sync_s=t_end - t_computed, checkpoint_s=checkpoint_s, loss=loss_value)
    if checkpointer is not None:
        t_close = time.time()
        checkpointer.close()
        log.write("closed", wait_s=time.time() - t_close)
    dist.barrier()
    log.write("done")
    return {"rank": rank, "attempt": attempt, "restored_step": start_step, "final_step": steps}


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

    def detection_table(self) -> list[dict[str, Any]]:
        rows = []
        for det in self.detections:
            nxt = self.next_attempt(det)
            rows.append({
                "attempt": det.attempt, "cause": det.cause, "rank": det.rank, "node cordoned": det.node,
                "replaced by": nxt.nodes[det.rank] if nxt else None, "fault": det.fault_id,
                "detect_s": round(det.t_detect - det.t_fault, 2) if det.t_fault else None,
                "recovery_s": round(nxt.t_first_step_end - (det.t_fault or det.t_detect), 2)
                if nxt and nxt.t_first_step_end else None,
                "resumed_from_step": nxt.restored_step if nxt else None,
            })
        return rows


class RecoveryError(RuntimeError):
    """The run cannot go on; ``rank_traceback`` is the failing rank's, where it reported one."""

    def __init__(self, message: str, rank_traceback: str | None = None):
        super().__init__(message)
        self.rank_traceback = rank_traceback


def _read_new(path: Path, offsets: dict[Path, int]) -> list[dict]:
    if not path.exists():
        return []
    with open(path) as handle:
        handle.seek(offsets.get(path, 0))
        data = handle.read()
    complete = data[: data.rfind("\n") + 1]
    offsets[path] = offsets.get(path, 0) + len(complete)
    return [json.loads(line) for line in complete.splitlines() if line]


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
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


@dataclass
class _Watch:
    """The supervisor's view of one attempt while it runs."""

    straggler_factor: float
    straggler_min_excess_s: float
    straggler_patience: int
    last_t: dict[int, float] = field(default_factory=dict)
    progress: dict[int, tuple[int, int]] = field(default_factory=dict)
    compute_s: dict[int, deque] = field(default_factory=dict)
    slow_streak: dict[int, int] = field(default_factory=dict)
    nonfinite: dict[int, dict] = field(default_factory=dict)
    straggler: tuple[int, str] | None = None
    steps_seen: int = 0
    done: set[int] = field(default_factory=set)
    ready: set[int] = field(default_factory=set)
    errors: dict[int, dict] = field(default_factory=dict)

    def feed(self, rank: int, record: dict) -> None:
        self.last_t[rank] = record["t"]
        event = record["event"]
        if event == "ready":
            self.ready.add(rank)
        elif event == "error":
            self.errors[rank] = record
        elif event == "computed":
            self.progress[rank] = (record["step"], 1)
        elif event == "step":
            self.progress[rank] = (record["step"], 2)
            self._judge(rank, record["compute_s"])
            self.compute_s.setdefault(rank, deque(maxlen=20)).append(record["compute_s"])
            self.steps_seen += 1
        elif event == "nonfinite":
            self.nonfinite[rank] = record
        elif event == "done":
            self.done.add(rank)

    def _judge(self, rank: int, compute_s: float) -> None:
        """A straggler's *own* compute time is an outlier against the other ranks'
        (everyone's step time is slow, because the all-reduce waits for it)."""
        others = [t for r, times in self.compute_s.items() if r != rank for t in times]
        if not others:
            return
        baseline = statistics.median(others)
        slow = compute_s > self.straggler_factor * baseline and compute_s - baseline > self.straggler_min_excess_s
        self.slow_streak[rank] = self.slow_streak.get(rank, 0) + 1 if slow else 0
        if self.slow_streak[rank] >= self.straggler_patience and self.straggler is None:
            self.straggler = (rank, f"compute {compute_s * 1e3:.0f} ms vs median {baseline * 1e3:.0f} ms "
                                    f"on the other ranks, {self.slow_streak[rank]} steps running")


def supervise(
    run_dir: str | Path,
    *,
    world_size: int = 2,
    spares: int = 2,
    faults: Sequence[Fault] = (),
    max_restarts: int | None = None,
    heartbeat_timeout_s: float = 5.0,
    startup_timeout_s: float = 120.0,
    straggler_factor: float = 3.0,
    straggler_min_excess_s: float = 0.15,
    straggler_patience: int = 3,
    poll_s: float = 0.02,
    warm_standby: bool = False,
    progress: Any = None,
    backend: str = "gloo",
    **train_kwargs: Any,
) -> RunReport:
    """Run :func:`train_rank` on ``world_size`` ranks until it finishes, recovering from failures.

    ``spares`` extra node slots stand by; each failure cordons the failed rank's
    node and moves that rank to a spare. ``run_dir`` (checkpoints, heartbeats,
    rank logs) is wiped first if it holds a previous run and refused if it holds
    anything else. ``progress`` is an optional tqdm bar advanced per step of rank 0.

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
    if straggler_patience < 1:
        raise ValueError(f"straggler_patience must be >= 1, got {straggler_patience}")
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

            def refill_standby() -> None:
                while warm_standby and len(warm) < world_size:
                    warm.append(_start_standby(run_path, run_id))
                    all_procs.append(warm[-1])

            outcome = _watch_attempt(
                report, procs, attempt, heartbeat_timeout_s, startup_timeout_s,
                (straggler_factor, straggler_min_excess_s, straggler_patience), poll_s, progress,
                on_training=refill_standby,
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
        return subprocess.Popen([sys.executable, "-m", "labkit.recovery", "--standby"], env=env, stdin=subprocess.PIPE,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, text=True)


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
                    [sys.executable, "-m", "labkit.recovery", "--kwargs", json.dumps(kwargs)],
                    env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def _watch_attempt(
    report: RunReport, procs: list[subprocess.Popen], attempt: int, heartbeat_timeout_s: float,
    startup_timeout_s: float, straggler: tuple[float, float, int], poll_s: float, progress: Any,
    on_training: Any = None,
) -> tuple[str, int, str, float] | None:
    """Poll until the attempt succeeds (None) or fails: (cause, blamed rank, detail, time).

    ``on_training`` runs once, after the first step: warm spares boot while the job
    trains rather than competing with its restart.
    """
    attempt_dir = report.run_dir / f"attempt-{attempt:03d}"
    records: dict[int, list[dict]] = {rank: [] for rank in range(len(procs))}
    report.records[attempt] = records
    offsets: dict[Path, int] = {}
    watch = _Watch(*straggler)
    t_launch = time.time()
    while True:
        for rank in records:
            for record in _read_new(attempt_dir / f"rank{rank}.jsonl", offsets):
                records[rank].append(record)
                watch.feed(rank, record)
                _note_attempt_progress(report, attempt, rank, record, progress)
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
            for rank in records:  # a NaN report may have landed just before the exit
                for record in _read_new(attempt_dir / f"rank{rank}.jsonl", offsets):
                    records[rank].append(record)
                    watch.feed(rank, record)
            if watch.nonfinite:
                rank = min(watch.nonfinite)
                return "nonfinite", rank, f"loss {watch.nonfinite[rank]['loss']}", now
            return ("exit", *_exit_verdict(failed, watch.errors), now)
        if watch.straggler is not None:
            return "straggler", watch.straggler[0], watch.straggler[1], now
        if watch.steps_seen and on_training is not None:
            on_training()
            on_training = None
        silence = _silence_verdict(watch, len(procs), now, now - t_launch, heartbeat_timeout_s, startup_timeout_s)
        if silence is not None:
            return ("hang", *silence, now)
        time.sleep(poll_s)


def _exit_verdict(failed: list[tuple[int, int]], errors: dict[int, dict]) -> tuple[int, str]:
    """(blamed rank, how it ended) among the ranks that exited (see :func:`labkit.triage.blame`)."""
    rank, code = triage.blame(failed, errors)
    how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
    if rank in errors:
        how += f" ({errors[rank]['error_type']}: {errors[rank]['message'][:200]})"
    return rank, how


def _silence_verdict(
    watch: _Watch, world_size: int, now: float, since_launch_s: float,
    heartbeat_timeout_s: float, startup_timeout_s: float,
) -> tuple[int, str] | None:
    """A hang, wherever it strikes: (blamed rank, detail), or None.

    Starting up (imports, rendezvous, loading the checkpoint) may take up to
    ``startup_timeout_s``. Once every rank has reported ready, silence from all of
    them for ``heartbeat_timeout_s`` is a hang, at the attempt's first step as at
    its hundredth (the others wait for the hung rank in the all-reduce): both are
    recovered the same way, from the last checkpoint on a spare.
    """
    if len(watch.ready) < world_size:
        if since_launch_s <= startup_timeout_s:
            return None
        rank = min(set(range(world_size)) - watch.ready)
        return rank, f"rank {rank} was not ready within startup_timeout_s={startup_timeout_s:g}s"
    if now - max(watch.last_t.values()) <= heartbeat_timeout_s:
        return None
    rank = min(set(range(world_size)) - watch.done, key=lambda r: (watch.progress.get(r, (-1, 0)), r))
    stalled = watch.progress.get(rank, (-1, 0))[0]
    where = f"after step {stalled}" if stalled >= 0 else "before its first step"
    return rank, f"no heartbeat for {heartbeat_timeout_s:g}s; rank {rank} stuck {where}"


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


def goodput(report: RunReport) -> GoodputBreakdown:
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


def model_beside_measured(report: RunReport, breakdown: GoodputBreakdown, checkpoint_every: int) -> dict[str, float]:
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
    return {
        "step_s": step_s, "interval_s": interval_s, "checkpoint_cost_s": checkpoint_cost_s,
        "mtbf_s": mtbf_s, "restart_s": restart_s,
        "young_daly_interval_s": young_daly_interval_s(max(checkpoint_cost_s, 1e-6), mtbf_s),
        "model_goodput": goodput_fraction(interval_s, checkpoint_cost_s, mtbf_s, restart_s),
        "measured_goodput": breakdown.useful_s / window_s,
        "model_lost_per_failure_s": (interval_s + checkpoint_cost_s) / 2,
        "measured_lost_per_failure_s": breakdown.lost_work_s / failures,
    }


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


def interval_sweep(
    *, checkpoint_cost_s: float, restart_s: float, mtbf_s: float, work_s: float,
    factors: Sequence[float] = (1 / 64, 1 / 16, 1 / 4, 1, 4, 16, 64), seed: int = 0,
) -> list[dict[str, float]]:
    """Goodput at multiples of the Young/Daly interval: simulated and the first-order model."""
    from labkit.interval import goodput_fraction, young_daly_interval_s

    optimum_s = young_daly_interval_s(checkpoint_cost_s, mtbf_s)
    return [
        {"factor": f, "interval_s": f * optimum_s,
         "simulated_goodput": simulate_goodput(f * optimum_s, checkpoint_cost_s=checkpoint_cost_s,
                                               restart_s=restart_s, mtbf_s=mtbf_s, work_s=work_s, seed=seed),
         "model_goodput": goodput_fraction(f * optimum_s, checkpoint_cost_s, mtbf_s, restart_s)}
        for f in factors
    ]


def final_weights(run_dir: str | Path) -> dict:
    """The model weights of the newest verified checkpoint of a run."""
    from labkit.checkpoint import load_latest

    latest = load_latest(Path(run_dir) / "checkpoints")
    if latest is None:
        raise FileNotFoundError(f"no verified checkpoint under {run_dir}/checkpoints")
    return latest.state["model"]


def bit_identical(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def plot_goodput(report: RunReport, breakdown: GoodputBreakdown):
    """Left: a timeline of the run by category. Right: where the wall time went."""
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
        timeline_ax.annotate(det.cause, (det.t_detect - report.t_start, -0.45), fontsize=8, color=plots.WARN)
    parts = breakdown.parts()
    plots.bars(bar_ax, list(parts), list(parts.values()), colors=[colors[k] for k in parts],
               fmt="{:.1f}", ylabel="seconds", title=f"where the wall time went (goodput {breakdown.goodput:.0%})")
    fig.tight_layout()
    return fig


def plot_interval_sweep(sweep: list[dict[str, float]]):
    from labkit import plots

    fig, (ax,) = plots.figure(1)
    xs = [row["interval_s"] for row in sweep]
    ax.plot(xs, [row["model_goodput"] for row in sweep], "--", color=plots.BASELINE, label="Young/Daly first-order model")
    ax.plot(xs, [row["simulated_goodput"] for row in sweep], "o-", color=plots.FIX, label="simulated failures")
    optimum = next(row["interval_s"] for row in sweep if row["factor"] == 1)
    ax.axvline(optimum, color=plots.GOOD, lw=1, label="sqrt(2 x cost x MTBF)")
    ax.set_xscale("log")
    ax.set_xlabel("checkpoint interval (s of work)")
    ax.set_ylabel("goodput")
    ax.set_title("goodput vs checkpoint interval")
    ax.legend()
    fig.tight_layout()
    return fig


def init_group_for_attempt(backend: str, timeout_s: float) -> None:
    """Join the process group under a store prefix unique to this restart.

    Under torchrun the ranks share the agent's store across restarts; keys from
    the failed attempt (peer addresses) would be read by the new one.
    """
    import datetime

    import torch
    import torch.distributed as dist

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=timeout_s)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=not agent_store and rank == 0, timeout=timeout)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, store=dist.PrefixStore(f"labkit-attempt-{restart_count()}", store),
                            rank=rank, world_size=world_size, timeout=timeout)


def _report_error(run_path: Path, exc: Exception) -> None:
    """Log the exception that ends this rank, so the supervisor can tell a bug from a bad node."""
    try:
        log = _EventLog(run_path / f"attempt-{restart_count():03d}" / f"rank{os.environ['RANK']}.jsonl")
        log.write("error", **triage.error_record(exc))
    except Exception:  # noqa: BLE001 - never hide the exception being reported
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of one rank, under the supervisor or torchrun."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m labkit.recovery", description=main.__doc__)
    parser.add_argument("--kwargs", default="{}", help="JSON object of train_rank keyword arguments (run_dir required)")
    parser.add_argument("--standby", action="store_true",
                        help="warm spare: import everything, then read one JSON line {env, kwargs, log} from stdin")
    args = parser.parse_args(argv)
    if args.standby:
        import torch  # noqa: F401 - the point of a warm spare is to pay for imports before it is needed

        import labkit.checkpoint  # noqa: F401

        line = sys.stdin.readline()
        if not line:
            return 0
        orders = json.loads(line)
        os.environ.update(orders["env"])
        log_fd = os.open(orders["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        args.kwargs = json.dumps(orders["kwargs"])
    if "RANK" not in os.environ:
        parser.error("RANK is not set: start this under torchrun, or call labkit.recovery.supervise()")
    kwargs = json.loads(args.kwargs)
    if "run_dir" not in kwargs:
        parser.error("--kwargs must name run_dir (a folder every rank can reach)")
    import torch
    import torch.distributed as dist

    backend = os.environ.get("LABKIT_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    os.environ["LABKIT_BACKEND"] = backend
    if backend == "gloo":
        torch.set_num_threads(1)
    try:
        init_group_for_attempt(backend, float(os.environ.get("LABKIT_TIMEOUT_S", 1800)))
        result = train_rank(**kwargs)
    except Exception as exc:
        _report_error(Path(kwargs["run_dir"]), exc)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
