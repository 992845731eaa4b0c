"""Write files and folders so that a crash never leaves half of one behind.

The pattern is the one databases use: write beside the target under a temporary
name, flush to disk, then ``rename`` -- a single atomic step on POSIX file
systems. A reader sees the old version or the new one, never a torn one.
"""

from __future__ import annotations

import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


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


@contextmanager
def atomic_directory(target: str | Path) -> Iterator[Path]:
    """Yield a temporary folder; on success it becomes ``target``.

    An existing ``target`` is replaced only after the new one is complete, so an
    interrupted rebuild keeps the previous folder intact.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary_sibling(target)
    tmp.mkdir()
    try:
        yield tmp
        old = None
        if target.exists():
            old = _temporary_sibling(target)
            os.replace(target, old)
        os.replace(tmp, target)
        fsync_dir(target.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def remove_stale_temporaries(folder: str | Path) -> int:
    """Delete temporaries left by a killed writer; returns how many went."""
    folder = Path(folder)
    if not folder.exists():
        return 0
    removed = 0
    for entry in folder.glob(".*.tmp-*"):
        pid = entry.name.rsplit(".tmp-", 1)[1].split("-", 1)[0]
        if pid.isdigit() and _alive(int(pid)):
            continue
        shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
        removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
