"""Every lab, unsabotaged, N times in a row: the course must pass 10 runs out of 10 on this machine.

Each run executes the labs in course order, each in a fresh kernel, exactly as
``labkit run`` does (:func:`labkit.course.runner.run_lab`). After every lab it looks for
what a lab must never leave behind: a ``labkit-*`` folder in the temp dir, an
``lk-*`` network namespace, a live child process. A flaky assert shows up as a
lab that passes some runs and fails others; the summary names the cell.

    python benchmarks/ten_runs.py [--runs 10] [--out data/ten-runs] [LAB ...]

Exercises run with their reference answers, as the test suite runs them (each check then also measures,
and must reject a wrong answer); ``LABKIT_SOLUTIONS=0`` runs them as a learner first sees them.

Exit status 1 when any lab failed any run or left something behind. A full run
of all eight labs takes 5-6 minutes on a 2-core CPU box, so 10 runs take about an hour.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import psutil

from labkit import netns
from labkit.course import Lab, select
from labkit.course.runner import RunStopped, run_lab, stopped_by_signals
from labkit.exercises import SOLUTIONS_ENV


def left_behind() -> list[str]:
    """What a finished lab should have removed: temp folders, namespaces, child processes."""
    found = [str(p) for p in Path(tempfile.gettempdir()).glob("labkit-*")]
    found += [f"netns {p.name}" for p in netns.NETNS_DIR.glob("lk-*")] if netns.NETNS_DIR.exists() else []
    found += [f"process {c.pid} {' '.join(c.cmdline())[:80]}" for c in psutil.Process().children(recursive=True)
              if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    return found


def host_steal_s() -> float:
    """CPU seconds the hypervisor gave to other guests (/proc/stat's steal), all cores together.

    A lab that fails while this jumps ran on a box that lost CPU it could not see:
    no program here is to blame, and the row says so.
    """
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def run_course(labs: list[Lab], runs: int, out: Path) -> dict[int, list[tuple[bool, float, str]]]:
    """Per lab number, one (passed, seconds, problem) per run."""
    outcomes: dict[int, list[tuple[bool, float, str]]] = defaultdict(list)
    for index in range(1, runs + 1):
        for lab in labs:
            stolen_before = host_steal_s()
            result = run_lab(lab, out / f"run{index:02d}", profile=None)
            stolen = host_steal_s() - stolen_before
            leftovers = left_behind()
            problem = re.sub(r"\x1b\[[0-9;]*m", "", result.error.splitlines()[-1]) if result.error else ""
            problem += f" left behind: {leftovers}" if leftovers else ""
            outcomes[lab.number].append((result.passed and not leftovers, result.seconds, problem))
            print(f"run {index}/{runs} lab {lab.number} {lab.slug}: "
                  f"{'passed' if not problem else 'FAILED ' + problem} ({result.seconds:.0f} s, "
                  f"{stolen:.1f} s stolen by the host)", flush=True)
    return outcomes


def summary(labs: list[Lab], outcomes: dict[int, list[tuple[bool, float, str]]]) -> str:
    lines = ["| lab | passed | seconds (min-max) | first problem |", "|---|---|---|---|"]
    for lab in labs:
        rows = outcomes[lab.number]
        seconds = [s for _, s, _ in rows]
        problems = [p for ok, _, p in rows if not ok]
        lines.append(f"| {lab.number} {lab.slug} | {sum(ok for ok, _, _ in rows)}/{len(rows)} | "
                     f"{min(seconds):.0f}-{max(seconds):.0f} | {problems[0] if problems else ''} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("labs", nargs="*", default=["all"])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("data") / "ten-runs")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")
    labs = select(args.labs)
    os.environ.setdefault(SOLUTIONS_ENV, "1")   # each lab's kernel inherits it
    start = time.monotonic()
    try:
        with stopped_by_signals():   # SIGTERM stops the running lab's kernel, as `labkit run` does
            outcomes = run_course(labs, args.runs, args.out.resolve())
    except RunStopped as stopped:
        print(f"{stopped}; nothing left behind: {not left_behind()}")
        return 128 + stopped.signum
    table = summary(labs, outcomes)
    print(f"\n{table}\n\n{args.runs} run(s) of {len(labs)} lab(s) in {(time.monotonic() - start) / 60:.0f} min")
    (args.out / "summary.md").write_text(table + "\n")
    return 0 if all(ok for rows in outcomes.values() for ok, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
