"""The three rates Lab 1's ladder depends on, measured apart, on whatever device this is.

    python benchmarks/lab01_gpu_terms.py [--workers 1 4 8 15]

1. the model's images/s at each width (what :func:`labkit.accelerator.model_width_for` picks from);
2. the in-RAM rung's host side alone: gather, pin, copy and flip per batch, with no model;
3. the files loader alone (decode in DataLoader workers, copy to the device), per worker count,
   timed after the first W batches as the lab's meter does (an H200 run that counted the start-up
   read 5400 images/s at 15 workers, where the lab's files rung reached 18,000).

The lab asserts orderings that hold only if (1) outruns (3) and (2) outruns (1); when a
rung's busy fraction surprises, these say which term moved. Written to find why the
in-RAM rung waited 15 ms a batch on an H200 machine.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from labkit import accelerator as accel
from labkit import dataset, ladder, loaders
from labkit.devices import synchronize, time_ms
from labkit.profiles import profile


def _per_batch_ms(iterable, device: torch.device, skip: int = 2) -> float:
    times, start = [], time.perf_counter()
    for _ in iterable:
        synchronize(device)
        now = time.perf_counter()
        times.append((now - start) * 1e3)
        start = now
    kept = sorted(times[skip:])
    return kept[len(kept) // 2]


def model_rates(device: torch.device, sizes: ladder.LadderSizes) -> dict[int, float]:
    images = torch.randint(0, 256, (sizes.batch_size, 3, sizes.image_px, sizes.image_px), dtype=torch.uint8, device=device)
    labels = torch.randint(0, 10, (sizes.batch_size,), device=device)
    rates = {}
    for width in accel.GPU_WIDTHS if device.type == "cuda" else (4, 8, 16):
        model = accel.ModelStep(device, width=width)
        best = min(time_ms(lambda: model.step(images, labels), device=device, warmup=2, repeats=5))
        rates[width] = round(sizes.batch_size / best * 1e3)
    return rates


def in_ram_parts(device: torch.device, sizes: ladder.LadderSizes) -> dict[str, float]:
    pixels = torch.randint(0, 256, (sizes.num_images, 3, sizes.image_px, sizes.image_px), dtype=torch.uint8)
    labels = torch.randint(0, 10, (sizes.num_images,))
    index = torch.randperm(sizes.num_images)[:sizes.batch_size]
    parts = {
        "gather": lambda: pixels.index_select(0, index),
        "gather+to_device": lambda: loaders.to_device(pixels.index_select(0, index), device),
        "gather+to_device+flip": lambda: loaders.flip_batch(loaders.to_device(pixels.index_select(0, index), device),
                                                           0, 0, index),
    }
    out = {name: round(sorted(time_ms(fn, device=device, warmup=3, repeats=20))[10], 3) for name, fn in parts.items()}
    batches = loaders.InRamBatches(pixels, labels, batch_size=sizes.batch_size, device=device)
    out["InRamBatches per batch"] = round(_per_batch_ms(batches, device), 3)
    return out


def loader_rates(device: torch.device, sizes: ladder.LadderSizes, workers: list[int]) -> dict[int, float]:
    data = dataset.generate(sizes.num_images)
    paths, labels = data.paths_and_labels()
    rates = {}
    for w in workers:
        loader = loaders.file_loader(paths, labels, batch_size=sizes.batch_size, image_px=sizes.image_px, num_workers=w)
        start, count = None, 0
        for i, (images, _) in enumerate(loader):
            loaders.to_device(images, device)
            if i == w:  # workers start together and their first batches arrive together: time the steady state
                synchronize(device)
                start = time.perf_counter()
            elif start is not None:
                count += len(images)
        synchronize(device)
        rates[w] = round(count / (time.perf_counter() - start)) if start and count else None
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4, 8, 15])
    args = parser.parse_args()
    prof = profile()
    sizes = prof.pick(ladder.SIZES)
    device = torch.device(prof.device)
    report = {"profile": prof.name, "model images/s by width": model_rates(device, sizes),
              "in-RAM host side, ms per batch": in_ram_parts(device, sizes),
              "files loader images/s by workers (no model)": loader_rates(device, sizes, args.workers)}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
