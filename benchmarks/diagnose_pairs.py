"""Check ``labkit diagnose`` where the truth is known: a baseline and its fix, with an independent measurement.

Each pair runs ``tests/scripts/ddp_train.py`` twice. The share the diagnosis gives the baseline's bottleneck is
set beside the share of the baseline's step that the fix removed (``1 - fixed step / baseline step``), both
with the profiler on (what the attribution must agree with) and off (the unprofiled steps each diagnosis
times first; the gap between the two is the profiler's own cost):

- data: 2 ms of loading per sample, against none (one rank);
- communication: two ranks, against one rank (no loading);
- checkpoint: a ``torch.save`` of model and Adam state every step, against none (one rank).

    python benchmarks/diagnose_pairs.py [--runs 3] [--steps 8]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from labkit import diagnosis_report

SCRIPT = Path(__file__).resolve().parent.parent / "tests" / "scripts" / "ddp_train.py"
PAIRS = {  # bottleneck: (baseline (nproc, args), fix (nproc, args))
    "data": ((1, ["2"]), (1, ["0"])),
    "communication": ((2, ["0"]), (1, ["0"])),
    "checkpoint": ((1, ["0", "1"]), (1, ["0"])),
}


def measure(nproc: int, args: list[str], steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="labkit-diagnose-pairs-") as out:
        return diagnosis_report.summarise(diagnosis_report.launch(SCRIPT, args, out=Path(out), nproc=nproc,
                                                                  steps=steps, warmup=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    print(f"{'pair':<14} {'run':>3} {'verdict':<14} {'share':>6} {'removed, profiled':>18} {'gap (pp)':>9} "
          f"{'removed, unprofiled':>20} {'overhead':>8}")
    for bottleneck, (base, fix) in PAIRS.items():
        for run in range(args.runs):
            before, after = measure(*base, args.steps), measure(*fix, args.steps)
            unprofiled = lambda s: sum(r["unprofiled_step_ms"] for r in s["ranks"]) / len(s["ranks"])  # noqa: E731
            removed = 1 - after["step_ms"] / before["step_ms"]
            share = before["shares"][bottleneck]
            print(f"{bottleneck:<14} {run:>3} {before['verdict']['bottleneck']:<14} {share:>6.0%} {removed:>18.0%} "
                  f"{100 * (share - removed):>+9.1f} {1 - unprofiled(after) / unprofiled(before):>20.0%} "
                  f"{before['overhead']:>8.2f}  (after the fix: {after['shares'][bottleneck]:.0%})")


if __name__ == "__main__":
    main()
