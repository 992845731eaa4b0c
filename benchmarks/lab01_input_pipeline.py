"""Lab 1 targets: transformed cache >= 0.85 of in-RAM images/s, file path <= 0.4 of it, in one run.

    python benchmarks/lab01_input_pipeline.py [--profile ci] [--repeats 1]
"""

from __future__ import annotations

import argparse

import labkit
from labkit import dataset, ladder
from labkit.devices import describe_machine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--profile", default=None)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    prof = labkit.profile(args.profile)
    sizes = prof.pick(ladder.SIZES)
    print(describe_machine())
    data = dataset.generate(sizes.num_images)
    ok = True
    for repeat in range(args.repeats):
        run = ladder.Ladder(data, sizes, ladder.accelerator_for(prof, sizes), device=prof.device)
        run.in_ram()
        run.files()
        run.transformed_cache()
        ram = run.results["in RAM"].items_per_s
        cached = run.results["transformed cache"].items_per_s / ram
        files = run.results["files"].items_per_s / ram
        for row in run.table():
            print(row)
        print(f"run {repeat}: transformed cache / in RAM = {cached:.2f} (target >= 0.85); "
              f"files / in RAM = {files:.2f} (target <= 0.40)")
        ok &= cached >= 0.85 and files <= 0.40
    print("targets met" if ok else "targets NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
