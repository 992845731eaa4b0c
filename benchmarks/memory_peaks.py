"""Peak memory of each lab, kernel and ranks together: does the course fit a Binder machine?

Binder gives about 2 GB of RAM. Each lab runs under ``labkit run`` in its own
process tree; every 0.5 s this script adds up the proportional set size (PSS:
shared pages split between the processes that map them, so two ranks sharing
torch's libraries are not counted twice) of the runner, its kernel and every
rank, and keeps the peak. Exit status 1 when a lab peaks at or over the limit.

    python benchmarks/memory_peaks.py [LAB ...] [--limit-gib 2.0]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time

import psutil

GIB = 2**30


def tree_pss_bytes(root: psutil.Process) -> int:
    """PSS of ``root`` and all its descendants; processes that vanish mid-count are skipped."""
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total


def peak_pss_bytes(lab: str, out: str, interval_s: float = 0.5) -> tuple[int, float, int]:
    """Run one lab headlessly; its peak tree PSS, wall seconds and exit code."""
    start = time.monotonic()
    run = subprocess.Popen([sys.executable, "-m", "labkit.course.cli", "run", lab, "--out", out],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    root, peak = psutil.Process(run.pid), 0
    while run.poll() is None:
        peak = max(peak, tree_pss_bytes(root))
        time.sleep(interval_s)
    return peak, time.monotonic() - start, run.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("labs", nargs="*", default=[str(n) for n in range(1, 9)])
    parser.add_argument("--limit-gib", type=float, default=2.0)
    args = parser.parse_args(argv)
    over = []
    with tempfile.TemporaryDirectory(prefix="labkit-memory-") as out:
        print(f"{'lab':>4} {'peak PSS GiB':>13} {'seconds':>8}  result")
        for lab in args.labs:
            peak, seconds, code = peak_pss_bytes(lab, out)
            verdict = "passed" if code == 0 else f"FAILED (exit {code})"
            print(f"{lab:>4} {peak / GIB:13.2f} {seconds:8.0f}  {verdict}", flush=True)
            if peak >= args.limit_gib * GIB:
                over.append(lab)
    if over:
        print(f"over {args.limit_gib} GiB: labs {', '.join(over)}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
