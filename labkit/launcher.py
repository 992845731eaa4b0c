"""Run a labkit function on N real processes, one per rank.

Distributed labs must use real processes and real collectives: a simulation in
one process hides exactly the costs the labs measure. ``launch`` starts the ranks
from a fork server (safe from a notebook: :func:`labkit.processes.fork_server_context`),
sets the variables ``torchrun`` would set, pins one thread per rank on the CPU
(otherwise two gloo ranks on two cores fight over threads and run ~10x slower),
initialises the process group, and returns each rank's result in rank order.

Failures are loud and leave nothing behind: a rank's exception is re-raised in
the caller with its remote traceback and the tail of its log; a hang ends with
:class:`RankTimeout`; in every case all ranks and their children are killed.

The same rank functions run under ``torchrun`` or the ``deepspeed`` launcher::

    torchrun --nproc-per-node 4 -m labkit.launcher labkit.gradsync:train_rank --kwargs '{"steps": 20}'
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Callable

from labkit import dsops
from labkit.processes import (MP_DIR_PREFIX, die_with_parent, fork_server_context, kill_group, killpg,
                              multiprocessing_base_dir, remove_folders_of_ended)


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: str


class RankError(RuntimeError):
    """A rank raised; carries its rank, remote traceback and log tail."""

    def __init__(self, rank: int, remote_traceback: str, log_tail: str):
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.log_tail = log_tail
        super().__init__(
            f"rank {rank} failed:\n{remote_traceback}"
            + (f"\n--- last lines of rank {rank}'s output ---\n{log_tail}" if log_tail else "")
        )


class RankTimeout(TimeoutError):
    pass


def rank_info() -> RankInfo:
    """This process's place in the job (valid inside a launched rank or under torchrun)."""
    backend = os.environ.get("LABKIT_BACKEND", "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    return RankInfo(
        rank=int(os.environ.get("RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
        local_rank=local_rank,
        backend=backend,
        device=f"cuda:{local_rank}" if backend == "nccl" else "cpu",
    )


def rank_device():
    """This rank's ``torch.device``: its GPU under NCCL, else the CPU (every rank-side module asks this)."""
    import torch

    return torch.device(rank_info().device)


AGENT_STORE_ENV = {"TORCHELASTIC_USE_AGENT_STORE": "True"}
"""What tells ``torch.distributed``'s ``env://`` rendezvous in every rank to join the launcher's store as a client."""


def rendezvous_store(timeout_s: float) -> Any:
    """The ranks' ``TCPStore``, held by the launcher as ``torchrun``'s agent holds it (see ``AGENT_STORE_ENV``).

    It binds port 0 and keeps the port: a port chosen free and released for rank 0 to bind later could be
    taken in between by another launch's store, and then two launches' ranks meet in one store (gloo's
    full mesh fails with "connection closed by peer"), as two tests run at once did.
    """
    import datetime

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def _function_ref(fn: Callable[..., Any]) -> str:
    module = getattr(fn, "__module__", None)
    if module in (None, "__main__") or "<locals>" in getattr(fn, "__qualname__", "<locals>"):
        raise ValueError(
            f"rank function {getattr(fn, '__qualname__', fn)!r} must be a top-level function "
            "in an importable module (put it in labkit/), not in a notebook cell: "
            "spawned ranks import it by name"
        )
    return f"{module}:{fn.__qualname__}"


def resolve(ref: str) -> Callable[..., Any]:
    """``"package.module:function"`` -> the function."""
    module_name, _, name = ref.partition(":")
    if not name:
        raise ValueError(f"expected 'module:function', got {ref!r}")
    return getattr(importlib.import_module(module_name), name)


BACKENDS = ("gloo", "nccl")


def check_backend(backend: str) -> None:
    """Refuse an unknown backend before anything expensive (op builds, processes) starts."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'gloo' (CPU ranks) or 'nccl' (one GPU per rank), got {backend!r}")


def _setup_rank_process(backend: str) -> None:
    os.environ["LABKIT_BACKEND"] = backend
    dsops.cache_cpu_info()
    if backend == "gloo":
        # A gloo rank is a CPU rank. On a GPU machine DeepSpeed would otherwise pick the
        # CUDA accelerator and put every rank's engine on a GPU (cuda:1 on a one-GPU box).
        os.environ["DS_ACCELERATOR"] = "cpu"
        import torch

        torch.set_num_threads(1)
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def _init_process_group(backend: str, timeout_s: float) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


def _leave_together(backend: str) -> None:
    """Wait until every rank has finished its function before any rank leaves its group.

    ``init_process_group`` can return on one rank while a peer is still connecting gloo's full mesh; a
    function with no collective in it then lets the first rank exit under the peer, which fails with
    "Connection closed by peer" (3 of 260 two-rank launches of a function that only reads the
    environment, beside three busy loops on the 2-core box, and none of 450 with this barrier; 2 of 6
    suite runs had met it in one test).
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier(device_ids=[int(os.environ["LOCAL_RANK"])] if backend == "nccl" else None)


def _rank_main(
    ref: str,
    rank: int,
    env: dict[str, str],
    kwargs: dict[str, Any],
    init_group: bool,
    log_path: str,
    conn: Connection,
) -> None:
    die_with_parent()
    os.setpgrp()
    log = open(log_path, "w", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    os.environ.clear()
    os.environ.update(env)
    try:
        if "LABKIT_NETNS" in env:  # placed on a labkit.fabric node: enter it before any socket opens
            from labkit.netns import enter_node

            enter_node(env["LABKIT_NETNS"])
        _setup_rank_process(env["LABKIT_BACKEND"])
        fn = resolve(ref)
        if init_group:
            _init_process_group(env["LABKIT_BACKEND"], float(env["LABKIT_TIMEOUT_S"]))
        result = fn(**kwargs)
        if init_group:
            _leave_together(env["LABKIT_BACKEND"])
        conn.send(("ok", result))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        conn.send(("error", f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}"))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - teardown after a failure must not mask it
            pass
        conn.close()


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


LOG_DIR_PREFIX = "labkit-ranks-"
KERNEL_DIR_PREFIX = "labkit-kernel-"
"""``labkit run``'s folder for a kernel's Unix sockets (:func:`labkit.course.runner.kernel_folder`)."""


def remove_stale_dirs() -> list[Path]:
    """Remove rank log, fork-server and kernel-socket folders whose process is gone; returns them.

    A failed launch keeps its ranks' logs for the person reading the error, for as
    long as the process that launched them (a notebook's kernel) lives; its fork
    server's socket folder lives as long (:func:`labkit.processes.own_multiprocessing_folder`).
    A process killed outright never cleans up, so every launch sweeps up after dead ones.
    """
    places = [(LOG_DIR_PREFIX, tempfile.gettempdir()), (MP_DIR_PREFIX, multiprocessing_base_dir()),
              (KERNEL_DIR_PREFIX, multiprocessing_base_dir())]
    return [folder for prefix, place in places for folder in remove_folders_of_ended(Path(place), prefix)]


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *,
    backend: str = "gloo",
    timeout_s: float = 300.0,
    init_process_group: bool = True,
    env: dict[str, str] | None = None,
    fabric: Any = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(**kwargs)`` on ``world_size`` fresh processes; results in rank order.

    ``fn`` must be importable (defined in a module, not a notebook cell) and its
    arguments and result picklable. ``env`` adds environment variables to every
    rank (use it to switch emulations on or off). With an open
    :class:`labkit.fabric.Fabric`, rank r runs on its topology's node for r, so
    traffic between nodes crosses the fabric's shaped links.
    """
    _check_launch(world_size, backend, timeout_s, fabric)
    ref = _function_ref(fn)
    dsops.use_environment_extensions_dir()
    # a fabric's ranks meet inside its own namespaces, on a port no other fabric shares
    store = rendezvous_store(timeout_s) if fabric is None else None
    remove_stale_dirs()
    log_dir = Path(tempfile.mkdtemp(prefix=f"{LOG_DIR_PREFIX}{os.getpid()}-"))
    ctx = fork_server_context()
    procs, conns, logs = [], [], []
    keep_logs = False
    try:
        for rank in range(world_size):
            rank_env = _rank_env(rank, world_size, store, backend, timeout_s, fabric, env)
            proc, parent_conn, log_path = _start_rank(ctx, ref, rank, rank_env, kwargs, init_process_group, log_dir)
            procs.append(proc)
            conns.append(parent_conn)
            logs.append(log_path)
        results = _collect(procs, conns, logs, timeout_s)
    except (RankError, RankTimeout) as exc:
        keep_logs = True
        exc.args = (f"{exc.args[0]}\n(every rank's full output is kept in {log_dir})",)
        raise
    finally:
        _stop_ranks(procs, conns)
        if not keep_logs:
            shutil.rmtree(log_dir, ignore_errors=True)
        del store   # closes its port now: a traceback kept by the notebook would otherwise keep it listening
    return results


def _check_launch(world_size: int, backend: str, timeout_s: float, fabric: Any) -> None:
    """Refuse a bad launch before any process starts, so the error names the argument, not a hung rank."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if fabric is not None and fabric.topology.world_size != world_size:
        raise ValueError(f"world_size must equal the fabric's {fabric.topology.world_size} rank slots, got {world_size}")
    check_backend(backend)
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")


def _rank_env(
    rank: int, world_size: int, store: Any, backend: str, timeout_s: float, fabric: Any, env: dict[str, str] | None
) -> dict[str, str]:
    """The caller's whole environment as it is now (a fork server's children would otherwise see the server's),
    then the variables ``torch.distributed`` reads (the ones ``torchrun`` would set), the fabric's and ``env``.
    Without a fabric the ranks join ``store``, the launcher's; a fabric's rank 0 hosts the store."""
    return {
        **os.environ,
        **({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), **AGENT_STORE_ENV} if store is not None else {}),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "LABKIT_BACKEND": backend,
        "LABKIT_TIMEOUT_S": str(timeout_s),
        **(fabric.rank_env(rank) if fabric is not None else {}),
        **(env or {}),
    }


def _start_rank(
    ctx: Any,
    ref: str,
    rank: int,
    rank_env: dict[str, str],
    kwargs: dict[str, Any],
    init_process_group: bool,
    log_dir: Path,
) -> tuple[mp.process.BaseProcess, Connection, Path]:
    """Spawn one rank with a one-way pipe for its result; the parent closes the child's end so EOF means it died."""
    parent_conn, child_conn = ctx.Pipe(duplex=False)
    log_path = log_dir / f"rank{rank}.log"
    proc = ctx.Process(
        target=_rank_main,
        args=(ref, rank, rank_env, kwargs, init_process_group, str(log_path), child_conn),
        name=f"labkit-rank{rank}",
    )
    proc.start()
    child_conn.close()
    return proc, parent_conn, log_path


def _stop_ranks(procs: list[mp.process.BaseProcess], conns: list[Connection]) -> None:
    """Kill every rank's process group, finished or not, so no grandchild outlives the launch."""
    for proc in procs:
        # a rank that already exited and was reaped may have left children in its group
        kill_group(proc.pid) if proc.exitcode is None else killpg(proc.pid, signal.SIGKILL)
        proc.join(timeout=1)
    for conn in conns:
        conn.close()


def _collect(
    procs: list[mp.process.BaseProcess],
    conns: list[Connection],
    logs: list[Path],
    timeout_s: float,
) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    results: dict[int, Any] = {}
    pending = dict(enumerate(conns))
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(pending)
            raise RankTimeout(
                f"ranks {missing} did not finish within timeout_s={timeout_s:g}s; "
                f"a rank may be hung in a collective. Last lines of rank {missing[0]}:\n"
                f"{_tail(logs[missing[0]])}"
            )
        ready = wait(list(pending.values()), timeout=min(remaining, 1.0))
        for conn in ready:
            rank = next(r for r, c in pending.items() if c is conn)
            try:
                status, payload = conn.recv()
            except EOFError:
                procs[rank].join(timeout=5)
                raise RankError(
                    rank,
                    f"process exited with code {procs[rank].exitcode} before returning a result",
                    _tail(logs[rank]),
                ) from None
            if status == "error":
                raise RankError(rank, payload, _tail(logs[rank]))
            results[rank] = payload
            del pending[rank]
    for proc in procs:
        proc.join(timeout=10)
    return [results[rank] for rank in range(len(procs))]


def run_under_external_launcher(ref: str, kwargs: dict[str, Any]) -> Any:
    """Entry point for torchrun/deepspeed: the launcher already set RANK etc."""
    backend = os.environ.get("LABKIT_BACKEND") or (
        "nccl" if _cuda_available() else "gloo"
    )
    _setup_rank_process(backend)
    _init_process_group(backend, float(os.environ.get("LABKIT_TIMEOUT_S", 1800)))
    try:
        return resolve(ref)(**kwargs)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m labkit.launcher",
        description="Run a labkit rank function under torchrun or the deepspeed launcher.",
    )
    parser.add_argument("function", help="module:function, e.g. labkit.gradsync:train_rank")
    parser.add_argument("--kwargs", default="{}", help="JSON object of keyword arguments")
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        parser.error("RANK is not set: start this under torchrun or deepspeed, or call labkit.launcher.launch()")
    result = run_under_external_launcher(args.function, json.loads(args.kwargs))
    print(json.dumps({"rank": os.environ["RANK"], "result": result}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
