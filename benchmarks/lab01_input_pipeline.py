"""Lab 1 targets, per run: the transformed cache keeps the accelerator >= 0.9 busy and >= 1.4x the
file path's busy fraction; one worker hides > 50% of the compute behind decoding; the remote rung runs
at 0.75-1.25x its Little's-law model (the notebook's asserts).

    python benchmarks/lab01_input_pipeline.py [--profile ci] [--repeats 1] [--gets-in-turn]

``--gets-in-turn`` makes the loader's workers take turns on the store (one GET at a time, as Lab 1's
sabotage does), to show what the remote rung's band must reject: about 0.5x with 2 workers.

On a CPU-only machine the accelerator is Lab 1's real model on a core of its own, made once and
reused by every repeat (as the notebook does).
"""

from __future__ import annotations

import argparse
import multiprocessing

import labkit
from labkit import accelerator as accel
from labkit import dataset, ladder, objectstore
from labkit.devices import describe_machine


def gets_in_turn() -> None:
    """Wrap ``HttpFetch.get`` in one lock that the forked DataLoader workers share."""
    get, lock = objectstore.HttpFetch.get, multiprocessing.Lock()

    def get_in_turn(self, url, byte_range=None):
        with lock:
            return get(self, url, byte_range)

    objectstore.HttpFetch.get = get_in_turn


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--profile", default=None)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--gets-in-turn", action="store_true")
    args = parser.parse_args()
    if args.gets_in_turn:
        gets_in_turn()
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
        sweep = run.worker_sweep(run.worker_counts())
        run.remote()
        busy = {rung: summary.busy_fraction for rung, summary in run.results.items()}
        hidden = ladder.hidden_compute_fraction(sweep[0], sweep[1])
        for row in run.table():
            print(row)
        print(f"run {repeat}: busy in RAM {busy['in RAM']:.2f}, transformed cache {busy['transformed cache']:.2f}, "
              f"files {busy['files']:.2f}; compute hidden by workers {hidden:.2f}; "
              f"remote rung {run.remote_vs_model():.3f}x its {run.remote_model.describe()}")
        ok &= (busy["transformed cache"] >= 0.9 and busy["transformed cache"] >= 1.4 * busy["files"]
               and hidden > 0.5 and 0.75 < run.remote_vs_model() < 1.25)
    if hasattr(accelerator, "close"):
        accelerator.close()
    print("targets met" if ok else "targets NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
