"""Processes a lab starts, and how to stop them: one implementation for the launcher, the runner,
the fabric and the crash-safe writers.

Signals go to a process *group* so that whatever a rank or a kernel started dies
with it; "running" treats a zombie as gone, because it has exited and only waits
for its parent to collect its status.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import multiprocessing.util
import os
import shutil
import tempfile
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn


def kill_group(pid: int | None, grace_s: float = 2.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``, to the process group led by ``pid`` and to ``pid`` itself.

    Signalling the pid too matters for a rank still starting up: until it has
    called ``setpgrp`` its group does not exist and ``killpg`` alone misses it.
    Children a rank started die with its group.
    """
    if pid is None:
        return
    deadline = time.monotonic() + grace_s
    for sig in (signal.SIGTERM, signal.SIGKILL):
        _signal(pid, sig)
        while sig == signal.SIGTERM and time.monotonic() < deadline and running(pid):
            time.sleep(0.05)
        if not running(pid):
            break
    killpg(pid, signal.SIGKILL)


def killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal(pid: int, sig: int) -> None:
    """``sig`` to the group ``pid`` leads and to ``pid`` itself."""
    killpg(pid, sig)
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def running(pid: int) -> bool:
    """Alive and not yet a zombie (a zombie has exited; only its parent's wait is missing)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


PR_SET_PDEATHSIG = 1


def exit_without_finalizing(status: int) -> NoReturn:
    """Flush stdout and stderr and leave at once, skipping the interpreter's finalization.

    For a child process whose work is done, committed and reported: native threads
    (Daft's runtime, a process group's) can call into a finalizing interpreter or be
    torn down joinable, and abort the process (``Fatal Python error: PyGILState_Release``;
    ``terminate called without an active exception``) after it succeeded. Only for
    processes with no exit hook left to run.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies.

    A rank runs in its own process group, so killing a notebook's kernel (a
    runner's hard stop, an out-of-memory kill) would otherwise leave it running.
    A no-op where prctl does not exist (macOS): there the launcher's own cleanup
    is all there is.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


_sigterm_holders: set[int] = set()
_sigterm_before: Any = None


def _sigterm_to_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def hold_sigterm(holder: object) -> None:
    """While ``holder`` (a fabric, an object store) is open, SIGTERM raises ``SystemExit``.

    By default SIGTERM ends Python without unwinding, so ``with`` blocks would
    leave namespaces and servers behind; as an exception it tears them down. A
    program that handles SIGTERM itself keeps its handler. Only the main thread
    can set handlers; elsewhere this does nothing.
    """
    global _sigterm_before
    if threading.current_thread() is not threading.main_thread():
        return
    if not _sigterm_holders and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        _sigterm_before = signal.signal(signal.SIGTERM, _sigterm_to_exit)
    _sigterm_holders.add(id(holder))


def release_sigterm(holder: object) -> None:
    """Undo :func:`hold_sigterm` for ``holder``; the default comes back when no holder is left."""
    global _sigterm_before
    _sigterm_holders.discard(id(holder))
    if _sigterm_holders or _sigterm_before is None or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is _sigterm_to_exit:
        signal.signal(signal.SIGTERM, _sigterm_before)
    _sigterm_before = None


@contextlib.contextmanager
def temporary_folder(prefix: str, parent: str | Path | None = None) -> Iterator[Path]:
    """A ``labkit-*`` folder that is removed on success, error, interrupt and SIGTERM.

    A lab stopped by ``labkit run`` gets SIGTERM; without :func:`hold_sigterm`
    Python would end without running the ``finally`` that removes the folder
    (a stopped ZeRO probe left its NVMe swap folder behind that way).
    """
    token = object()
    hold_sigterm(token)
    try:
        folder = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    finally:
        release_sigterm(token)


RANK_SERVER = "labkit.rank_server"
"""The module the fork server imports: torch once for every rank (not DeepSpeed: it picks its accelerator on import)."""


def fork_server_context() -> Any:
    """The multiprocessing context ranks start from: a fork server that has imported torch once.

    Spawn (a fresh interpreter per rank) is safe from a notebook but makes every rank of every
    launch import torch again: ~1.7 s a launch on the 2-core CI box, for a course that launches
    ranks dozens of times. A fork server is as safe (a clean process started by spawn that has done
    nothing but these imports: no CUDA context, no lock held) and forks ranks with torch already
    imported (a launch of two trivial ranks: 0.05 s after the first, against 1.6-2.4 s).
    It lives as long as the process that started it and dies with it (:mod:`labkit.rank_server`). What a rank
    must see of its parent now, not of the server's birth, travels with it: the environment
    (the launcher's ``_rank_env``) and, through multiprocessing's own preparation data, the working folder
    and ``sys.path``.
    """
    own_multiprocessing_folder()
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([RANK_SERVER])
    return ctx


def remove_folders_of_ended(place: Path, prefix: str) -> list[Path]:
    """Remove the folders in ``place`` named ``<prefix><pid>`` or ``<prefix><pid>-...`` whose process has
    ended; returns them. A process killed outright never removes what it named for itself."""
    removed = []
    for folder in Path(place).glob(f"{prefix}*"):
        pid = folder.name[len(prefix):].split("-")[0]
        if folder.is_dir() and pid.isdigit() and not running(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


MP_DIR_PREFIX = "labkit-mp-"
AF_UNIX_PATH_MAX = 107
"""Bytes in a Unix socket's path: the fork server's socket lives in this folder, ``listener-`` + 8 more."""


def multiprocessing_base_dir() -> str:
    """The temp dir, or ``/tmp`` where a socket under the temp dir would pass :data:`AF_UNIX_PATH_MAX`.

    A pytest ``tmp_path`` as TMPDIR (66 characters here) made ``bind`` fail with
    "AF_UNIX path too long"; Python 3.13's multiprocessing falls back to /tmp the same way.
    """
    base = tempfile.gettempdir()
    longest = len(base) + len(f"/{MP_DIR_PREFIX}{2**22}-12345678/listener-12345678")
    return base if longest <= AF_UNIX_PATH_MAX else "/tmp"


def own_multiprocessing_folder() -> Path:
    """This process's multiprocessing folder, named ``labkit-mp-<pid>-*`` so a sweep can find it once the pid is gone.

    multiprocessing keeps the fork server's socket in a ``pymp-*`` folder of its own
    and removes it at a clean interpreter exit only. A notebook's kernel is often
    stopped by a kill (nbclient's shutdown, ``labkit run`` on a signal), and the
    folder stayed in /tmp for good: 181 of them had piled up on the 2-core box in a
    few hours of test runs. :func:`labkit.launcher.remove_stale_dirs` sweeps these like the
    rank log folders. Only a folder multiprocessing has not chosen yet can be named.
    """
    config = multiprocessing.process.current_process()._config  # where multiprocessing.util.get_temp_dir looks
    if config.get("tempdir") is None:
        folder = tempfile.mkdtemp(prefix=f"{MP_DIR_PREFIX}{os.getpid()}-", dir=multiprocessing_base_dir())
        multiprocessing.util.Finalize(None, shutil.rmtree, args=(folder, True), exitpriority=-100)
        config["tempdir"] = folder
    return Path(config["tempdir"])
