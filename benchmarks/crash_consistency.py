"""Crash consistency of Lab 7's checkpoints: SIGKILL a saving process at random instants.

    python benchmarks/crash_consistency.py               # 50 kills, sync and async savers
    python benchmarks/crash_consistency.py --kills 200 --dir /mnt/nvme   # longer, on another file system

After every kill, loading must return the newest committed checkpoint, bit-identical
to what was saved, from its own folder (never a temporary), or raise a clear error
(see labkit.crashcheck). Prints a summary; exit status 1 on any violation.
"""

from __future__ import annotations

import argparse
import sys

from labkit import crashcheck


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=50, help="how many SIGKILLs (default 50)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill delays (default 0)")
    parser.add_argument("--max-delay-s", type=float, default=0.25,
                        help="each kill comes after a delay drawn uniformly from [0, this] (default 0.25)")
    parser.add_argument("--dir", default=None, help="where to create the temporary checkpoint folder (default: $TMPDIR)")
    args = parser.parse_args(argv)
    report = crashcheck.run(args.kills, seed=args.seed, max_delay_s=args.max_delay_s, parent=args.dir)
    print(report.summary())
    if not any(r.landed_mid_save for r in report.rounds):
        print("note: no kill landed inside a save this time; raise --kills or --max-delay-s")
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
