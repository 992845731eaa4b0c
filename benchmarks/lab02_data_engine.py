"""Lab 2 targets: the Daft decode pipeline against Lab 1's PIL DataLoader, and the tensor cache.

Targets (issue 3), on the same images and the same cores:
  * Daft native decode+resize pipeline >= 1.3x the PIL DataLoader;
  * tensor-cache Parquet (written by Daft) >= 3x the PIL DataLoader.

Each loader is drained end to end (start-up included) over every image; the best of
``--repeats`` passes counts, and the loaders take turns within each pass, so a busy
spell on a shared machine hits them alike. Each pass also prints the CPU time per image
of the whole loader (this process and its DataLoader workers): a loader that is faster
only because it used the cores better shows the same CPU per image. Use >= 10k images:
below that, start-up dominates. "daft pipeline" is what labkit ships (Daft decodes, torch
resizes inside a Daft batch function); "daft, own resize" keeps Daft's ``resize`` for
comparison.

    python benchmarks/lab02_data_engine.py [--images 10000] [--image-px 32] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys

os.environ.setdefault("DAFT_ANALYTICS_ENABLED", "0")

import daft  # noqa: E402

from labkit import catalog, dataengine, dataset, loaders, representations# noqa: E402
from labkit.devices import describe_machine, load_average, loader_workers  # noqa: E402
from labkit.paths import data_dir  # noqa: E402

TARGETS = {"daft pipeline": 1.3, "tensor cache": 3.0}


def cpu_seconds() -> float:
    """CPU of this process and of its reaped children (a DataLoader joins its workers at the end)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=dataengine.BENCHMARK_IMAGES)
    parser.add_argument("--image-px", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--cores", type=int, default=loader_workers())
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if args.images < 10_000:
        print(f"note: {args.images} images; the targets assume >= 10,000 (start-up dominates below)")
    daft.set_runner_native(num_threads=args.cores)
    print(describe_machine())

    ds = dataset.generate(args.images)
    frame = catalog.read_catalog(ds)
    job = frame.select("path", "label").to_pydict()
    workdir = data_dir() / "lab02" / ds.name
    cache = representations.write_tensor_cache(frame, workdir / f"tensors_{args.image_px}px.parquet", args.image_px)
    packed = representations.write_packed(frame, workdir / "packed.parquet")
    print(f"{ds.num_images} images; tensor cache written in {cache.write_s:.1f} s "
          f"({cache.disk_bytes / 1e6:.1f} MB), packed in {packed.write_s:.1f} s ({packed.disk_bytes / 1e6:.1f} MB)")

    loaders_under_test = {
        "PIL DataLoader": lambda: loaders.file_loader(
            job["path"], job["label"], batch_size=args.batch_size, image_px=args.image_px,
            num_workers=args.cores, augment=False),
        "daft pipeline": lambda: representations.file_batches(frame, args.image_px, args.batch_size),
        "daft, own resize": lambda: representations.file_batches(
            frame, args.image_px, args.batch_size, resizer="daft"),
        "daft packed": lambda: representations.packed_batches(packed.path, args.image_px, args.batch_size),
        "tensor cache": lambda: representations.cache_batches(cache.path, args.batch_size),
    }
    rates = dict.fromkeys(loaders_under_test, 0.0)
    for repeat in range(args.repeats):
        for name, make in loaders_under_test.items():
            cpu = cpu_seconds()
            images, seconds = dataengine.drain(make())
            cpu_ms = 1e3 * (cpu_seconds() - cpu) / images
            rates[name] = max(rates[name], images / seconds)
            print(f"pass {repeat + 1}  {name:16s} {images / seconds:9.0f} images/s  {cpu_ms:6.3f} CPU ms/image   "
                  f"(load average {load_average():.1f})")
    print("best of each:", {name: round(rate) for name, rate in rates.items()})

    baseline = rates["PIL DataLoader"]
    missed = []
    for name, target in TARGETS.items():
        ratio = rates[name] / baseline
        verdict = "met" if ratio >= target else "MISSED"
        print(f"{name:16s} {ratio:5.2f}x the PIL DataLoader (target >= {target}x): {verdict}")
        if ratio < target:
            missed.append(name)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
