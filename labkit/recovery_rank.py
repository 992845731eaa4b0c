"""One rank of Lab 8's training job: it trains, checkpoints, logs a heartbeat, and fails on purpose.

The job is real ``torch.distributed`` ranks (gloo on the CPU, nccl on GPUs)
training a small MLP with an explicit gradient all-reduce and checkpointing with
Lab 7's savers. Each rank writes one JSON heartbeat record per phase of every
step, which is all the supervisor (:mod:`labkit.recovery`) knows of it, and
injects the faults it is told to -- really: SIGKILL of its own process, a sleep
that never ends, a slow node, a NaN loss.

The supervisor starts each rank as ``python -m labkit.recovery_rank`` with the
variables torchrun sets, so the same entry point runs under torchrun's own
restart loop on a real cluster (``run_dir`` on a shared file system)::

    torchrun --nnodes 2 --nproc-per-node 8 --max-restarts 3 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29400 -m labkit.recovery_rank \\
        --kwargs '{"run_dir": "/shared/run1", "steps": 1000}'

torchrun restarts every worker after any exit and sets TORCHELASTIC_RESTART_COUNT,
which the rank reads; it does not cordon nodes or watch heartbeats and
stragglers -- that is what the supervisor adds (a hung collective there ends
at the process-group timeout, ``LABKIT_TIMEOUT_S``). The entry point keys its
rendezvous by restart count: with torch 2.13 a restarted gloo group otherwise
read the previous attempt's peer addresses from torchrun's store and failed.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from labkit import processes, triage
from labkit.fault_plan import Fault

RUN_ID_VAR = "LABKIT_RUN_ID"

RESTART_VAR = "LABKIT_RESTART_COUNT"

TORCHELASTIC_RESTART_VAR = "TORCHELASTIC_RESTART_COUNT"
STRAGGLE_SLOWDOWN = 0.3
"""How much more work a straggling node does per step: 0.3, a node 30% slower than its peers, the hard
case in a real fleet (1.0 would be half speed). Whether it can be told apart depends on how far healthy
ranks drift on the machine (:func:`labkit.stragglers.slowdown_to_show`)."""


def restart_count() -> int:
    """Which attempt this is: torchrun's count where present, else the supervisor's."""
    return int(os.environ.get(TORCHELASTIC_RESTART_VAR, os.environ.get(RESTART_VAR, 0)))


class EventLog:
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
    """A three-layer classifier; every rank seeds torch the same way before making it."""
    from labkit.models import mlp

    return mlp([features, hidden, hidden, classes])


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
    straggle_slowdown: float = STRAGGLE_SLOWDOWN,
    faults: Sequence[dict] = (),
) -> dict:
    """One rank of the supervised job; resumes from the newest verified checkpoint.

    A committed checkpoint that will not load raises (:func:`labkit.checkpoint.load_for_resume`)
    rather than quietly starting again from step 0.

    Data-parallel SGD with momentum: every rank computes gradients on its own
    batch, one all-reduce averages them, rank 0 saves. Checkpoint ``k`` holds the state after
    ``k`` steps (``loader_position=k``). A straggling rank's node takes ``1 + straggle_slowdown``
    times as long to compute (1.0: half speed).
    """
    import torch.distributed as dist

    from labkit.launcher import rank_device
    from labkit.savers import AsyncSaver, SyncSaver

    if saver not in ("async", "sync"):
        raise ValueError(f"saver must be 'async' or 'sync', got {saver!r}")
    if not 0 < straggle_slowdown <= 10:
        raise ValueError(f"straggle_slowdown must be in (0, 10] (0.2 = 20% slower), got {straggle_slowdown}")
    _watch_parent()
    run_path = Path(run_dir)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    attempt = restart_count()
    log = EventLog(run_path / f"attempt-{attempt:03d}" / f"rank{rank}.jsonl")
    device = rank_device()

    model, optimizer, start_step, restore_s = _build_and_resume(run_path, features, hidden, lr, seed, device)
    checkpointer = (AsyncSaver if saver == "async" else SyncSaver)(run_path / "checkpoints", keep=3) if rank == 0 else None
    log.write("ready", restored_step=start_step, restore_s=restore_s, pid=os.getpid(),
              node=os.environ.get("LABKIT_NODE", ""))

    mine = {f.step: f for f in (Fault(**d) for d in faults) if f.rank == rank and not _fault_marker(run_path, f).exists()}
    straggling = False
    for step in range(start_step, steps):
        t_start = time.time()
        fault = mine.get(step)
        if fault is not None:
            _fire(run_path, fault, log)
            straggling = straggling or fault.kind == "straggle"
        batch = make_batch(step, rank, seed=seed, batch_size=batch_size, features=features)
        loss_value, t_computed, compute_s = _train_step(model, optimizer, batch, device, log, rank, step, world_size,
                                                        nan=fault is not None and fault.kind == "nan",
                                                        slowdown=straggle_slowdown if straggling else 0.0)
        t_end = time.time()
        checkpoint_s = _maybe_checkpoint(checkpointer, model, optimizer, step + 1, steps, checkpoint_every)
        log.write("step", step=step, t_start=t_start, t_end=t_end, compute_s=compute_s,
                  sync_s=t_end - t_computed, checkpoint_s=checkpoint_s, loss=loss_value)
    _finish(checkpointer, log)
    return {"rank": rank, "attempt": attempt, "restored_step": start_step, "final_step": steps}


def _maybe_checkpoint(checkpointer: Any, model: Any, optimizer: Any, done: int, steps: int,
                      checkpoint_every: int) -> float:
    """Seconds the trainer was blocked saving after ``done`` steps; every ``checkpoint_every`` and at the end."""
    from labkit.checkpoint import capture_training_state

    if checkpointer is None or (done % checkpoint_every != 0 and done != steps):
        return 0.0
    state = capture_training_state(model, optimizer, loader_position=done)
    return checkpointer.save(done, state).blocked_s


def _finish(checkpointer: Any, log: EventLog) -> None:
    """Wait for the last write (an async save may still be in flight), then for every rank, then log "done"."""
    import torch.distributed as dist

    if checkpointer is not None:
        t_close = time.time()
        checkpointer.close()
        log.write("closed", wait_s=time.time() - t_close)
    dist.barrier()
    log.write("done")


def _train_step(model: Any, optimizer: Any, batch: tuple[Any, Any], device: Any, log: EventLog, rank: int, step: int,
                world_size: int, *, nan: bool, slowdown: float) -> tuple[float, float, float]:
    """Forward, backward, gradient average, update; returns the loss, when compute ended and how long it
    took on the device's clock (:func:`compute_clock`), for the heartbeat.

    ``nan`` and ``slowdown`` are injected faults: a poisoned loss; a slow node, emulated by working on
    for ``slowdown`` x the step's compute after the backward -- the condition is set, its detection is
    the supervisor's own measurement.
    """
    import torch

    clock = compute_clock(device)
    c_start = clock()
    x, y = batch
    loss = torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))
    if nan:
        loss = loss * float("nan")
    loss_value = _checked_loss_value(loss, log, rank, step)
    optimizer.zero_grad(set_to_none=False)
    loss.backward()
    if slowdown:
        until = clock() + slowdown * (clock() - c_start)
        while clock() < until:
            pass
    compute_s = clock() - c_start
    t_computed = time.time()
    log.write("computed", step=step)
    _average_gradients(list(model.parameters()), world_size)
    optimizer.step()
    return loss_value, t_computed, compute_s


def compute_clock(device: Any) -> Callable[[], float]:
    """The clock a step's compute is timed on: the thread's CPU time on a CPU rank, the wall clock after
    a synchronize on a GPU.

    Why not the wall clock everywhere: ranks sharing a few cores wait for the scheduler, and the wall
    clock counts that wait as the rank's compute. CPU time counts only the work, as CUDA events count
    only the kernels. (What told a slow rank from healthy ones here was comparing fastest steps,
    :class:`labkit.stragglers.StragglerRule`: on either clock, healthy ranks' median steps drifted apart.)
    """
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        def synchronized() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()
        return synchronized
    return time.thread_time


def _build_and_resume(run_path: Path, features: int, hidden: int, lr: float, seed: int,
                      device: Any) -> tuple[Any, Any, int, float]:
    """Model, optimizer, the step to resume at, from the newest verified checkpoint, and the seconds that
    finding, verifying and loading it took (a restart's reload, which Lab 8 reports apart).

    Every rank must land on the same step, or the ranks would train different models.
    """
    import torch
    import torch.distributed as dist

    from labkit.checkpoint import load_for_resume, restore_training_state

    torch.manual_seed(seed)
    model = make_model(features, hidden).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    t_reload = time.time()
    latest = load_for_resume(run_path / "checkpoints")
    start_step = restore_training_state(latest.state, model, optimizer) if latest else 0
    restore_s = time.time() - t_reload
    agreed = torch.tensor([start_step, -start_step], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    if agreed[0].item() != -agreed[1].item():
        raise RuntimeError(f"ranks restored different checkpoints (steps {-agreed[1].item()}..{agreed[0].item()})")
    return model, optimizer, start_step, restore_s


def _fire(run_path: Path, fault: Fault, log: EventLog) -> None:
    """Inject ``fault`` once per run: its marker file stops a restarted rank from firing it again."""
    _fault_marker(run_path, fault).parent.mkdir(parents=True, exist_ok=True)
    _fault_marker(run_path, fault).touch()
    log.write("fault", kind=fault.kind, step=fault.step, fault_id=fault.fault_id)
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.kind == "hang":
        while True:
            time.sleep(3600)


def _checked_loss_value(loss: Any, log: EventLog, rank: int, step: int) -> float:
    """The loss as a float; a non-finite one stops the rank before its gradients reach the weights."""
    loss_value = loss.item()
    if not math.isfinite(loss_value):
        log.write("nonfinite", step=step, loss=loss_value)
        raise FloatingPointError(f"rank {rank}: loss is {loss_value} at step {step}; stopping before it reaches the weights")
    return loss_value


def _average_gradients(params: list[Any], world_size: int) -> None:
    """One all-reduce of all gradients flattened together, then divide: the mean gradient on every rank."""
    import torch
    import torch.distributed as dist

    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    flat /= world_size
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset: offset + p.numel()].view_as(p.grad))
        offset += p.numel()


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
        log = EventLog(run_path / f"attempt-{restart_count():03d}" / f"rank{os.environ['RANK']}.jsonl")
        log.write("error", **triage.error_record(exc))
    except Exception:  # noqa: BLE001 - never hide the exception being reported
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of one rank, under the supervisor or torchrun."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m labkit.recovery_rank", description=main.__doc__)
    parser.add_argument("--kwargs", default="{}", help="JSON object of train_rank keyword arguments (run_dir required)")
    parser.add_argument("--standby", action="store_true",
                        help="warm spare: import everything, then read one JSON line {env, kwargs, log} from stdin")
    args = parser.parse_args(argv)
    if args.standby:
        import torch  # noqa: F401 - the point of a warm spare is to pay for imports before it is needed

        import labkit.savers  # noqa: F401

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
    # A rank that returned has written every record and left its group. A rank restarted
    # under torchrun then aborted while the interpreter finalized ("terminate called without
    # an active exception", both ranks had logged "done"; 2 of 30 restarts beside a busy
    # process here), and torchrun counts that exit as a failure. An exception still ends
    # the rank the normal way, with its traceback.
    processes.exit_without_finalizing(main())
