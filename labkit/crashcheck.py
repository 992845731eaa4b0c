"""Kill a process while it saves checkpoints, again and again; the loader must never be fooled.

Lab 7 claims that a crash at any instant leaves the newest committed checkpoint
loadable and never passes off a torn one. This is the experiment behind the
claim. A forked child saves checkpoints in a loop with :class:`SyncSaver` or
:class:`AsyncSaver` and logs each step twice: when it begins the save, and once
the saver reports it committed. After a random delay we SIGKILL it, then load
with :func:`labkit.checkpoint.load_latest`. The load must return a step between
the last one logged as committed and the last one begun (the kill may land
between a commit and its log line), bit-identical to the state saved at that
step (recomputed: every step's state is a function of the step), from that
step's own folder. A clear :class:`CheckpointError` is acceptable only before
anything was committed: a kill must not cost a committed checkpoint. The next child
resumes from what loaded, in the same folder, so torn folders and stale
temporaries from earlier kills are part of the test.

A SIGKILL checks the order of writes, renames and fsyncs as the kernel sees
them. It does not simulate losing power: that guarantee rests on the fsyncs.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from labkit.checkpoint import CheckpointError, list_checkpoints, load_latest, step_dir, verify
from labkit.savers import SAVERS

STATE_NUMEL = 250_000
_CHILD_MAX_S = 60.0


def expected_state(step: int) -> dict:
    """The state saved at ``step``: model-like tensors of several dtypes plus plain data."""
    generator = torch.Generator().manual_seed(step)
    return {
        "model": {"weight": torch.randn(STATE_NUMEL, generator=generator),
                  "bias": torch.randn(64, generator=generator).to(torch.bfloat16)},
        "optimizer": {"step": torch.tensor(step), "counts": torch.randint(0, 1 << 30, (1000,), generator=generator)},
        "loader_position": step,
        "extra": {"note": f"step {step}", "loss": step / 7, "flags": (True, None)},
    }


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def same_bits(a: Any, b: Any) -> bool:
    """Equal down to the bit: tensors by dtype, shape and bytes (``torch.equal`` calls -0.0 == 0.0)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and _raw(a).equal(_raw(b)))
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b))
    return a == b


def _child(directory: Path, kind: str, first_step: int, log_fd: int, parent_pid: int) -> None:
    """Save steps first_step, first_step + 1, ... until killed (or orphaned); log begin and commit."""
    saver = SAVERS[kind](directory, keep=2)
    logged, step, deadline = 0, first_step, time.monotonic() + _CHILD_MAX_S
    while os.getppid() == parent_pid and time.monotonic() < deadline:
        os.write(log_fd, f"begin {step}\n".encode())
        saver.save(step, expected_state(step))
        for stats in saver.history[logged:]:
            os.write(log_fd, f"commit {stats.step}\n".encode())
        logged = len(saver.history)
        step += 1


def _run_child(directory: Path, kind: str, first_step: int, log_path: Path, delay_s: float) -> str | None:
    """Fork a saving child, SIGKILL it after ``delay_s``; None, or why it died on its own."""
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            _child(directory, kind, first_step, log_fd, parent)
        except BaseException as exc:  # noqa: BLE001 - reported to the parent through the log
            os.write(log_fd, f"error {type(exc).__name__}: {exc}\n".encode())
            code = 1
        finally:
            os._exit(code)
    os.close(log_fd)
    try:
        time.sleep(delay_s)
    finally:
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        return None
    return f"the saving child exited on its own (status {status}) before the kill"


def _read_log(log_path: Path) -> tuple[int | None, int | None, str | None]:
    """(last step begun, last step logged as committed, child error) from one child's log."""
    began = committed = error = None
    for line in log_path.read_text().splitlines():
        word, _, rest = line.partition(" ")
        if word == "begin":
            began = int(rest)
        elif word == "commit":
            committed = int(rest)
        elif word == "error":
            error = rest
    return began, committed, error


@dataclass(frozen=True)
class KillRound:
    """One kill and the load after it. ``problem`` is set only for a violation."""

    index: int
    kind: str
    delay_s: float
    began: int | None
    committed: int | None
    loaded: int | None
    torn_folders: int
    temporaries: int
    error: str | None = None
    problem: str | None = None

    @property
    def landed_mid_save(self) -> bool:
        """The kill left evidence of an unfinished save: the case the design is for."""
        return self.torn_folders > 0 or self.temporaries > 0


def _damage(directory: Path) -> tuple[int, int]:
    """(step folders that do not verify, temporary files left inside step folders)."""
    torn = temporaries = 0
    for _, folder in list_checkpoints(directory):
        try:
            torn += verify(folder) is not None
        except CheckpointError:
            torn += 1
        temporaries += len(list(folder.glob(".*.tmp-*")))
    return torn, temporaries


def _judge_load(directory: Path, floor: int | None, began: int | None) -> tuple[int | None, str | None, str | None]:
    """(loaded step, clear error, violation) for the load after a kill.

    ``floor`` is the newest step known committed; ``began`` the newest step begun.
    A clear error is acceptable only while nothing is known committed: a kill
    alone must never make a committed checkpoint unloadable.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            checkpoint = load_latest(directory)
    except CheckpointError as exc:
        return None, str(exc), None if floor is None else f"step {floor} was committed, but the load raised"
    if checkpoint is None:
        return None, None, None if floor is None else f"nothing loaded, but step {floor} was committed"
    step = checkpoint.step
    if floor is not None and step < floor:
        return step, None, f"loaded step {step}, older than committed step {floor}"
    if began is not None and step > began:
        return step, None, f"loaded step {step}, newer than any step begun ({began})"
    if checkpoint.path != step_dir(directory, step):
        return step, None, f"loaded {checkpoint.path}, not the folder of step {step}"
    if not same_bits(checkpoint.state, expected_state(step)):
        return step, None, f"step {step} loaded but is not bit-identical to what was saved"
    return step, None, None


@dataclass
class CrashReport:
    rounds: list[KillRound] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def violations(self) -> list[KillRound]:
        return [r for r in self.rounds if r.problem is not None]

    def summary(self) -> str:
        lines = [f"{len(self.rounds)} kills in {self.wall_s:.1f} s"]
        for kind in sorted({r.kind for r in self.rounds}):
            rounds = [r for r in self.rounds if r.kind == kind]
            ok = [r for r in rounds if r.problem is None and r.error is None]
            newer = sum(r.loaded is not None and r.committed is not None and r.loaded > r.committed for r in ok)
            lines.append(
                f"  {kind:5}: {len(rounds)} kills, {len(ok)} loads OK "
                f"({sum(r.loaded is not None for r in ok)} returned a checkpoint, {newer} of them a step committed "
                f"after the last log line), {sum(r.landed_mid_save for r in rounds)} kills landed mid-save, "
                f"newest step loaded {max((r.loaded for r in ok if r.loaded is not None), default=None)}, "
                f"{sum(r.error is not None for r in rounds)} clear errors"
            )
        lines += [f"  error in kill {r.index} ({r.kind}): {r.error}" for r in self.rounds if r.error]
        lines += [f"  VIOLATION in kill {r.index} ({r.kind}): {r.problem}" for r in self.violations]
        lines.append(f"violations: {len(self.violations)}")
        return "\n".join(lines)


def _one_round(work: Path, index: int, kind: str, floor: int | None, delay_s: float) -> KillRound:
    directory = work / kind
    log_path = work / f"kill-{index:03d}.log"
    died = _run_child(directory, kind, 0 if floor is None else floor + 1, log_path, delay_s)
    began, committed, child_error = _read_log(log_path)
    torn, temporaries = _damage(directory)
    known = max((s for s in (floor, committed) if s is not None), default=None)
    loaded, error, problem = _judge_load(directory, known, began if began is not None else floor)
    problem = problem or died or (f"the child raised {child_error}" if child_error else None)
    return KillRound(index, kind, delay_s, began, committed, loaded, torn, temporaries, error, problem)


def run(kills: int = 50, *, seed: int = 0, max_delay_s: float = 0.25, parent: str | Path | None = None) -> CrashReport:
    """``kills`` SIGKILLs, alternating SyncSaver and AsyncSaver, each after a random
    delay in [0, ``max_delay_s``]; checkpoints go to a temporary folder (under
    ``parent`` if given: the file system is part of what is tested), always removed."""
    if kills < 1:
        raise ValueError(f"kills must be >= 1, got {kills}")
    if max_delay_s <= 0:
        raise ValueError(f"max_delay_s must be > 0, got {max_delay_s}")
    torch.set_num_threads(1)  # no thread pool in the parent when it forks
    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="labkit-crash-", dir=parent))
    report, floors = CrashReport(), {}
    start = time.perf_counter()
    try:
        for index in range(kills):
            kind = ("sync", "async")[index % 2]
            done = _one_round(work, index, kind, floors.get(kind), rng.uniform(0.0, max_delay_s))
            report.rounds.append(done)
            if done.loaded is not None:
                floors[kind] = done.loaded
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report.wall_s = time.perf_counter() - start
    return report
