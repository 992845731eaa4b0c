"""Start, hand orders to, and kill the rank processes of one attempt of a supervised run.

:func:`labkit.recovery.supervise` decides *when* to launch and whom to blame; this
module is how: one process per rank in its own process group (so a kill takes its
children too), with the variables torchrun sets, started cold or handed to a warm
spare that has already imported torch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections import deque
from dataclasses import asdict
from pathlib import Path

from labkit.launcher import AGENT_STORE_ENV
from labkit.processes import killpg
from labkit.fault_plan import Fault
from labkit.recovery_rank import RESTART_VAR, RUN_ID_VAR, TORCHELASTIC_RESTART_VAR

RANK_MODULE = "labkit.recovery_rank"
"""What each rank runs (``python -m``), under this supervisor or under torchrun."""


def kill_rank(proc: subprocess.Popen) -> None:
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


def start_standby(run_path: Path, run_id: str) -> subprocess.Popen:
    """A warm spare process: it imports torch and labkit now and waits for its orders on stdin."""
    folder = run_path / "standby"
    folder.mkdir(exist_ok=True)
    env = {**os.environ, RUN_ID_VAR: run_id, "LABKIT_SUPERVISOR_PID": str(os.getpid()), "OMP_NUM_THREADS": "1"}
    env.pop(TORCHELASTIC_RESTART_VAR, None)
    with open(folder / f"process-{uuid.uuid4().hex[:8]}.log", "w") as log:
        return subprocess.Popen([sys.executable, "-m", RANK_MODULE, "--standby"], env=env, stdin=subprocess.PIPE,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, text=True)


def refill_standby(warm: deque, all_procs: list[subprocess.Popen], world_size: int, run_path: Path,
                    run_id: str) -> None:
    """Boot warm spares until there is one per rank (called once the attempt trains)."""
    while len(warm) < world_size:
        warm.append(start_standby(run_path, run_id))
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


def check_devices_for_nodes(backend: str, nodes: int) -> None:
    """NCCL ranks need a GPU per node slot, spares included, before anything starts."""
    if backend != "nccl":
        return
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if nodes > gpus:
        raise ValueError(f"backend='nccl' puts each of world_size + spares = {nodes} node slots on a GPU of "
                         f"its own, and this machine has {gpus}; lower spares or world_size, or use "
                         f"backend='gloo'")


def launch_attempt(
    run_path: Path, run_id: str, attempt: int, assignment: list[int], nodes: list[str],
    plan: list[Fault], train_kwargs: dict, warm: deque | None, backend: str, store_port: int,
) -> list[subprocess.Popen]:
    """Start (cold) or hand orders to (warm) one process per rank, with torchrun's variables; the ranks join
    the supervisor's store on ``store_port`` (:func:`labkit.launcher.rendezvous_store`), as under torchrun."""
    from labkit import dsops

    dsops.use_environment_extensions_dir()
    attempt_dir = run_path / f"attempt-{attempt:03d}"
    attempt_dir.mkdir(parents=True, exist_ok=True)
    kwargs = {**train_kwargs, "run_dir": str(run_path), "faults": [asdict(f) for f in plan]}
    world_size = len(assignment)
    procs = []
    for rank, node in enumerate(assignment):
        rank_env = {
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store_port), **AGENT_STORE_ENV,
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
                kill_rank(proc)
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
