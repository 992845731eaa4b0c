"""The same job under torchrun's elastic agent, the engine a cluster runs, measured beside the supervisor.

``torchrun --max-restarts N`` watches its worker processes and, when one exits, stops
the others and starts them all again (``TORCHELASTIC_RESTART_COUNT`` counts the
restarts); the rank resumes from its newest checkpoint, as under
:func:`labkit.recovery.supervise`. What the agent does not do is what the lab's
supervisor adds: it watches no heartbeats (a hang lasts until the process group
times out), judges no stragglers, cordons no node and keeps no spare, and cannot tell
a program error from a node's (:mod:`labkit.triage`). Here both run the same entry
point (``python -m labkit.recovery_rank``) on the same job, so a killed rank's
recovery can be timed the same way under each, from the ranks' own records.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from labkit.fault_plan import Fault
from labkit.heartbeat import read_new
from labkit.processes import kill_group
from labkit.recovery_report import RunReport


RESTART_BAND = (0.6, 1.6)
"""torchrun's fault-to-next-step time over the supervisor's for the same kill: both pay process start,
imports, rendezvous and reload. On the 2-core CI box ten pairs of runs gave 0.86-1.20
(``python benchmarks/lab08_recovery_and_placement.py --only-straggler --straggler-runs 0 --elastic-pairs 5``),
ten runs of Lab 8 0.76-1.15."""


@dataclass(frozen=True)
class ElasticRun:
    """What torchrun did with a job: its exit, the attempts it ran, and a failure's cost from the records."""

    run_dir: Path
    returncode: int
    wall_s: float
    attempts: int
    fault_to_next_step_s: float | None
    restored_step: int | None
    redone_steps: int
    stderr_tail: str

    def describe(self) -> str:
        return (f"torchrun: exit {self.returncode}, {self.attempts} attempts in {self.wall_s:.1f} s; fault -> next "
                f"training step {self.fault_to_next_step_s:.2f} s, resumed from step {self.restored_step}, "
                f"{self.redone_steps} steps redone" if self.fault_to_next_step_s is not None else
                f"torchrun: exit {self.returncode}, {self.attempts} attempts in {self.wall_s:.1f} s, no fault recovered")


def run_torchrun(run_dir: str | Path, *, world_size: int, faults: Sequence[Fault], max_restarts: int,
                 timeout_s: float = 300.0, **train_kwargs) -> ElasticRun:
    """Run the job with ``faults`` under ``torchrun --standalone --max-restarts``; the rendezvous is on loopback.

    torchrun's own temp folder goes inside ``run_dir``; whatever happens here (an error, a timeout, an
    interrupt), torchrun's process group is killed before this returns or raises.
    """
    from labkit.recovery import fresh_run_dir

    if max_restarts < 0:
        raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    run_path = fresh_run_dir(Path(run_dir))
    (run_path / "tmp").mkdir()
    kwargs = {**train_kwargs, "run_dir": str(run_path), "faults": [vars(f) for f in faults]}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world_size),
               "--max-restarts", str(max_restarts), "-m", "labkit.recovery_rank", "--kwargs", json.dumps(kwargs)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(run_path / "tmp")}
    start = time.time()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"torchrun ran past timeout_s={timeout_s:g}; its processes were killed") from None
    finally:
        kill_group(proc.pid)
    return _read_run(run_path, proc.returncode, time.time() - start, stderr)


def _read_run(run_path: Path, returncode: int, wall_s: float, stderr: str) -> ElasticRun:
    """A failure's cost from the ranks' records: the fault's instant to the next attempt's first step."""
    attempts = sorted(run_path.glob("attempt-*"))
    records = [[r for path in sorted(folder.glob("rank*.jsonl")) for r in read_new(path, {})] for folder in attempts]
    faults = [r for r in (records[0] if records else []) if r["event"] == "fault"]
    if not faults or len(records) < 2:
        return ElasticRun(run_path, returncode, wall_s, len(attempts), None, None, 0, stderr[-2000:])
    first_steps = [r["t_end"] for r in records[1] if r["event"] == "step"]
    restored = min((r["restored_step"] for r in records[1] if r["event"] == "ready"), default=None)
    done_before = {r["step"] for r in records[0] if r["event"] == "step"}
    redone = sum(1 for step in done_before if restored is not None and step >= restored)
    return ElasticRun(run_path, returncode, wall_s, len(attempts),
                      min(first_steps) - faults[0]["t"] if first_steps else None, restored, redone, stderr[-2000:])


def print_side_by_side(under_torchrun: ElasticRun, supervised: RunReport, fault: Fault) -> None:
    """The same kill recovered by torchrun's agent and by the lab's supervisor, one row each, measured."""
    detection = next(d for d in supervised.detections if d.fault_id == fault.fault_id)
    nxt = supervised.next_attempt(detection)
    print(f"{'':>12} {'fault -> next step':>19} {'resumed from':>13} {'steps redone':>13}  node")
    if under_torchrun.fault_to_next_step_s is None:
        print(f"{'torchrun':>12} {'no next step':>19} {'-':>13} {'-':>13}  (exit {under_torchrun.returncode}, "
              f"{under_torchrun.attempts} attempt)")
    else:
        print(f"{'torchrun':>12} {under_torchrun.fault_to_next_step_s:>17.2f} s {under_torchrun.restored_step:>13} "
              f"{under_torchrun.redone_steps:>13}  the same (restarted in place)")
    print(f"{'supervisor':>12} {nxt.t_first_step_end - detection.t_fault:>17.2f} s {nxt.restored_step:>13} "
          f"{supervised.redone_steps(detection):>13}  {detection.node} cordoned, rank {detection.rank} moved to "
          f"{nxt.nodes[detection.rank]}")
