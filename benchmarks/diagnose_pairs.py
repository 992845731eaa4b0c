"""Check ``labkit diagnose`` where the truth is known: a baseline and its fix, with an independent measurement.

Each pair runs ``tests/scripts/ddp_train.py`` twice. The share the diagnosis gives the baseline's bottleneck is
set beside the share of the baseline's step that the fix removed (``1 - fixed step / baseline step``), both
with the profiler on (what the attribution must agree with) and off (the unprofiled steps each diagnosis
times first; the gap between the two is the profiler's own cost):

- data: 2 ms of loading per sample, against none (one rank);
- communication: two ranks on nodes joined by a slow shaped link (``--link-gbit``, 0.5 Gbit/s, Lab 5's
  slow rate), against one rank (no loading). The all-reduce is then most of the step; what the fix removes
  beyond it is the second rank's share of the two cores and DDP's bucket copies (in six diagnoses 0.5-1.5 ms
  more compute and 0.3-0.8 ms more "other" a step than one rank's), which the diagnosis rightly does not
  call communication. On loopback, without the link, that pair gave shares of 38-65% against 38-81%
  removed (10 runs). A fast link is no better a fix to compare with: at 100 Gbit/s gloo's copies through
  the namespaces' links still took 42-67% of the step;
- checkpoint: a ``torch.save`` of model and Adam state every step, against none (one rank).

    python benchmarks/diagnose_pairs.py [--runs 3] [--steps 8] [--link-gbit 0.5] [--only PAIR ...]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from labkit import diagnosis_report

SCRIPT = Path(__file__).resolve().parent.parent / "tests" / "scripts" / "ddp_train.py"
PAIRS = {  # bottleneck: (baseline (nproc, args, on the shaped link?), fix (nproc, args, on the shaped link?))
    "data": ((1, ["2"], False), (1, ["0"], False)),
    "communication": ((2, ["0"], True), (1, ["0"], False)),
    "checkpoint": ((1, ["0", "1"], False), (1, ["0"], False)),
}


def measure(nproc: int, args: list[str], shaped: bool, steps: int, slow_gbit: float) -> dict:
    link_gbit = slow_gbit if shaped else None
    with tempfile.TemporaryDirectory(prefix="labkit-diagnose-pairs-") as out:
        return diagnosis_report.summarise(diagnosis_report.launch(SCRIPT, args, out=Path(out), nproc=nproc,
                                                                  steps=steps, warmup=2, link_gbit=link_gbit))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--link-gbit", type=float, default=0.5, help="the communication pair's slow link")
    parser.add_argument("--only", choices=sorted(PAIRS), nargs="+", default=sorted(PAIRS))
    args = parser.parse_args()
    if args.link_gbit <= 0:
        parser.error(f"--link-gbit must be a rate > 0, got {args.link_gbit}")
    print(f"{'pair':<14} {'run':>3} {'verdict':<14} {'share':>6} {'removed, profiled':>18} {'gap (pp)':>9} "
          f"{'removed, unprofiled':>20} {'overhead':>8}")
    for bottleneck, (base, fix) in PAIRS.items():
        if bottleneck not in args.only:
            continue
        for run in range(args.runs):
            before, after = measure(*base, args.steps, args.link_gbit), measure(*fix, args.steps, args.link_gbit)
            unprofiled = lambda s: sum(r["unprofiled_step_ms"] for r in s["ranks"]) / len(s["ranks"])  # noqa: E731
            removed = 1 - after["step_ms"] / before["step_ms"]
            share = before["shares"][bottleneck]
            print(f"{bottleneck:<14} {run:>3} {before['verdict']['bottleneck']:<14} {share:>6.0%} {removed:>18.0%} "
                  f"{100 * (share - removed):>+9.1f} {1 - unprofiled(after) / unprofiled(before):>20.0%} "
                  f"{before['overhead']:>8.2f}  (after the fix: {after['shares'][bottleneck]:.0%})")


if __name__ == "__main__":
    main()
