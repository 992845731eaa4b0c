"""Write files and folders so that a crash never leaves half of one behind.

The pattern is the one databases use: write beside the target under a temporary
name, flush to disk, then ``rename`` -- a single atomic step on POSIX file
systems. A reader sees the old version or the new one, never a torn one.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from labkit.processes import running


def fsync_dir(path: Path) -> None:
    """Persist a rename: the directory entry lives in the parent's inode."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temporary_sibling(target: Path) -> Path:
    return target.with_name(f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


@contextmanager
def atomic_file(target: str | Path) -> Iterator[Path]:
    """Yield a temporary path; on success it replaces ``target`` atomically."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary_sibling(target)
    try:
        yield tmp
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, target)
        fsync_dir(target.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_bytes_atomic(target: str | Path, data: bytes) -> None:
    with atomic_file(target) as tmp:
        tmp.write_bytes(data)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(new: Path, old: Path) -> bool:
    """Swap two paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``).

    ``rename(2)`` cannot replace a non-empty folder; exchanging can. False where the
    C library or the file system does not offer it (macOS, NFS, old kernels).
    """
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError, TypeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(new), _AT_FDCWD, os.fsencode(old), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(code, f"exchanging {new} and {old}: {os.strerror(code)}")


def _replace_directory(tmp: Path, target: Path) -> Path | None:
    """Put ``tmp`` at ``target``; returns where the old folder now is (to delete)."""
    if not target.exists():
        os.replace(tmp, target)
        return None
    if _exchange(tmp, target):
        return tmp
    old = _temporary_sibling(target)
    os.replace(target, old)
    try:
        os.replace(tmp, target)
    except BaseException:
        os.replace(old, target)
        raise
    return old


@contextmanager
def atomic_directory(target: str | Path) -> Iterator[Path]:
    """Yield a temporary folder; on success it becomes ``target``.

    The guarantee: at every instant ``target`` is the old complete folder or the
    new complete one. An interrupted build leaves the old one untouched; a
    replacement swaps the two folders in one atomic step (``renameat2`` with
    ``RENAME_EXCHANGE`` on Linux: ext4, xfs, btrfs, tmpfs). Where the file system
    cannot swap, the old folder is renamed aside and the new one renamed in: for
    the time between those two renames ``target`` is absent (never partial), so a
    reader there should retry a missing folder once. A crash after the swap
    leaves the old folder under a temporary name for :func:`remove_stale_temporaries`.

    The guarantee is about the path. Two lookups may straddle a swap (read a
    manifest that names everything, or retry if versions differ), and a reader
    still inside the old folder loses it when it is deleted after the swap (files
    it has open stay readable). Checkpoints need none of this: each step is
    written to a folder of its own and committed by its manifest.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary_sibling(target)
    tmp.mkdir()
    old = None
    try:
        yield tmp
        old = _replace_directory(tmp, target)
        fsync_dir(target.parent)
    finally:
        for leftover in (tmp, old):
            if leftover is not None and leftover.exists():
                shutil.rmtree(leftover, ignore_errors=True)


def remove_stale_temporaries(folder: str | Path) -> int:
    """Delete temporaries left by a killed writer; returns how many went."""
    folder = Path(folder)
    if not folder.exists():
        return 0
    removed = 0
    for entry in folder.glob(".*.tmp-*"):
        pid = entry.name.rsplit(".tmp-", 1)[1].split("-", 1)[0]
        if pid.isdigit() and running(int(pid)):
            continue
        shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
        removed += 1
    return removed
