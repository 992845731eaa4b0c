"""Whether a file was read from the disk or from RAM: the page cache, dropped and counted.

Linux keeps the files a process reads in spare RAM (the page cache). A cache file of
a few megabytes, written a moment ago, is then read from memory, not from the disk
it is said to live on, and a lab that times it measures RAM. Lab 1 drops its
transformed cache from the page cache before each epoch (:func:`drop`) and counts
the bytes its process then fetched from storage (:func:`disk_read_bytes`), so it
can say which of the two it measured.

Dropping needs ``posix_fadvise`` (Linux, and most Unix) and leaves alone the pages
a process still has mapped: a memory map of the file must be closed first.
Counting needs ``/proc/self/io``; where either is missing the functions say so
(``False``, ``None``) instead of pretending.
"""

from __future__ import annotations

import os
from pathlib import Path


def drop(path: str | Path) -> bool:
    """Write ``path``'s dirty pages out, then ask the kernel to forget its cached pages.

    Returns False where the platform has no ``posix_fadvise``. The kernel may keep
    pages that a process has mapped; the next read of the others goes to storage.
    """
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


def disk_read_bytes() -> int | None:
    """Bytes this process has caused to be fetched from storage, from ``/proc/self/io``.

    Reads served by the page cache do not count; page faults of a memory map do.
    None where the kernel does not report it.
    """
    try:
        with open("/proc/self/io") as io:
            for line in io:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None
