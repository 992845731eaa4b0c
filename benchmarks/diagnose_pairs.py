"""Check ``labkit diagnose`` where the truth is known: a baseline and its fix, with an independent measurement.

Each pair runs ``tests/scripts/ddp_train.py`` twice. The share the diagnosis gives the baseline's bottleneck is
set beside the share of the baseline's step that the fix removed, timed without the profiler
(``1 - fixed step / baseline step``, from the unprofiled steps each diagnosis times first):

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
    print(f"{'pair':<14} {'run':>3} {'verdict':<14} {'share':>6} {'removed by fix':>15} {'gap (pp)':>9} "
          f"{'overhead':>8}")
    for bottleneck, (base, fix) in PAIRS.items():
        for run in range(args.runs):
            before, after = measure(*base, args.steps), measure(*fix, args.steps)
            unprofiled = lambda s: sum(r["unprofiled_step_ms"] for r in s["ranks"]) / len(s["ranks"])  # noqa: E731
            removed = 1 - unprofiled(after) / unprofiled(before)
            share = before["shares"][bottleneck]
            print(f"{bottleneck:<14} {run:>3} {before['verdict']['bottleneck']:<14} {share:>6.0%} {removed:>15.0%} "
                  f"{100 * (share - removed):>+9.1f} {before['overhead']:>8.2f}  "
                  f"(after the fix: {after['shares'][bottleneck]:.0%})")


if __name__ == "__main__":
    main()
