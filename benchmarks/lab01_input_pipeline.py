"""Lab 1 targets, per run: the transformed cache keeps the accelerator >= 0.9 busy and >= 1.4x the
file path's busy fraction; one worker hides > 50% of the compute behind decoding; the remote rung runs
at 0.75-1.25x its Little's-law model (the notebook's asserts).

    python benchmarks/lab01_input_pipeline.py [--profile ci] [--repeats 1] [--sabotage TEXT]

``--sabotage TEXT`` first applies the Lab 1 sabotage of ``tests/test_sabotage.py`` whose name contains
TEXT, to show the figures an assert must reject: ``--sabotage "take turns"`` (the workers take turns on
the store, one GET at a time) puts the remote rung near 0.5x its model with 2 workers.

On a CPU-only machine the accelerator is Lab 1's real model on a core of its own, made once and
reused by every repeat (as the notebook does).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

import labkit
from labkit import accelerator as accel
from labkit import dataset, decode_overlap, ladder
from labkit.devices import describe_machine


def apply_sabotage(text: str) -> None:
    """Run the code of the one Lab 1 sabotage whose name contains ``text`` (the suite keeps one copy of it)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for tests/
    from tests.test_sabotage import SABOTAGES

    chosen = [s for s in SABOTAGES if s.notebook.startswith("01_") and text in s.name]
    if len(chosen) != 1:
        names = [s.name for s in SABOTAGES if s.notebook.startswith("01_")]
        raise SystemExit(f"--sabotage {text!r} must name exactly one of Lab 1's sabotages: {names}")
    print("sabotaged:", chosen[0].name)
    exec(compile(textwrap.dedent(chosen[0].code), "<sabotage>", "exec"), {"__name__": "__sabotage__"})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--profile", default=None)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--sabotage", default=None, metavar="TEXT")
    args = parser.parse_args()
    if args.sabotage:
        apply_sabotage(args.sabotage)
    prof = labkit.profile(args.profile)
    sizes = prof.pick(ladder.SIZES)
    print(describe_machine())
    data = dataset.generate(sizes.num_images)
    accelerator = ladder.accelerator_for(prof, sizes, data)
    print("accelerator:", accel.describe(accelerator))
    ok = True
    for repeat in range(args.repeats):
        run = ladder.Ladder(data, sizes, accelerator, device=prof.device)
        run.in_ram()
        run.files()
        run.transformed_cache()
        sweep = run.worker_sweep(run.worker_counts(), steps_per_batch=run.balanced_steps())
        run.remote()
        busy = {rung: summary.busy_fraction for rung, summary in run.results.items()}
        hidden = decode_overlap.hidden_compute_fraction(sweep[0], sweep[1])
        for row in run.table():
            print(row)
        print(f"run {repeat}: busy in RAM {busy['in RAM']:.2f}, transformed cache {busy['transformed cache']:.2f}, "
              f"files {busy['files']:.2f}; compute hidden by workers {hidden:.2f}; "
              f"remote rung {run.remote_vs_model():.3f}x its {run.remote_model.describe()}")
        ok &= (busy["transformed cache"] >= 0.9 and busy["transformed cache"] >= 1.4 * busy["files"]
               and sweep[1].busy_fraction > decode_overlap.OVERLAP_BUSY_GAIN * sweep[0].busy_fraction and 0.75 < run.remote_vs_model() < 1.25)
    if hasattr(accelerator, "close"):
        accelerator.close()
    print("targets met" if ok else "targets NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
