"""Measure in a fresh Python process: one JSON line back, an allocator chosen for what is measured.

A CPU has no allocator counter, so Labs 2, 4 and 7 read peak memory as the kernel's resident-set
high-water mark. In the process that runs the notebook that mark is moved by everything earlier cells
allocated and freed: glibc serves new arrays from heap pages it kept, so a second Run All measured a
stream of decoded images at 0.21 of the kept column instead of 0.15. A fresh process started with
:data:`PEAK_ALLOCATOR_ENV` gives every large allocation its own mapping, returned to the kernel when
freed, so the mark follows the arrays alive. A measurement of time wants the opposite (freed blocks
reused, no page faults per step: see :data:`labkit.recompute.TIMES_ALLOCATOR_ENV`), so the
allocator settings are the caller's.

The module run must print its result as the last line of its output, as JSON, and should import the
functions it measures from the package (``from labkit import x``), not use its ``__main__`` copy, so
that a test that patches them patches what is measured.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

PEAK_ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
"""Every allocation over 64 KiB its own mapping, returned to the kernel when freed; one thread, as measured."""


def run_module(module: str, *args: str, env: dict[str, str], what: str, timeout_s: float = 600.0) -> Any:
    """``python -m module args...`` with ``env`` added to this environment; its last output line, parsed as JSON.

    ``what`` names the measurement in the error a failed run raises, with the end of its stderr.
    """
    if not module or timeout_s <= 0:
        raise ValueError(f"module must be named and timeout_s > 0, got {module!r} and {timeout_s}")
    out = subprocess.run([sys.executable, "-m", module, *args], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"{what} failed (python -m {module}, exit {out.returncode}):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
