"""The object-store server under load: its own capacity, then Lab 1's and Lab 2's loaders reading from it.

(0) capacity: ``--capacity-requests`` GETs of the dataset's small JPEGs by ``--client-threads``
    threads, at ``--first-byte-ms`` and at 0 ms; the ideal at the emulated latency is
    threads / latency. Below it, the server (or the cores it shares with the clients) is the
    bottleneck, not the latency it emulates.
(a) a torch DataLoader, ``--workers`` workers, fetching through ``HttpFetch`` and decoding with PIL;
(b) Daft ``download()`` + ``decode_image()`` + resize over the same URLs
(both through :func:`labkit.store_race.measure`, as Lab 2's race).

Requests are counted from the server's log; server CPU is read from /proc. ``--first-byte-ms``
is an EMULATED condition (the server waits before answering); everything printed is measured.

    python benchmarks/object_store.py [--images 1000] [--first-byte-ms 10] [--workers 2] [--target 3]

Exit status 1 when Daft delivers under ``--target`` times the PIL DataLoader's images/s.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("DAFT_ANALYTICS_ENABLED", "0")

from labkit import dataengine, dataset, store_race  # noqa: E402
from labkit.devices import describe_machine, load_average  # noqa: E402
from labkit.objectstore import HttpFetch, ObjectStore  # noqa: E402


def server_cpu_s(pid: int) -> float:
    """User + system CPU seconds the server process has used so far."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Measured:
    """Wall time, server requests, bytes and server CPU over a ``with`` block."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    def __enter__(self) -> "Measured":
        self.log_at, self.cpu_at, self.start = len(self.store.log()), server_cpu_s(self.store.pid), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start
        self.server_cpu_s = server_cpu_s(self.store.pid) - self.cpu_at
        records = self.store.log()[self.log_at:]
        self.requests = len(records)
        self.failed = sum(r["status"] >= 400 for r in records)
        self.megabytes = sum(r["bytes"] for r in records) / 1e6

    def line(self, name: str, items: int, unit: str) -> str:
        return (f"{name:34s} {items / self.seconds:8.0f} {unit}/s  {self.seconds:6.2f} s  server log: "
                f"{self.requests} requests ({self.failed} failed), {self.megabytes:.1f} MB, "
                f"server CPU {1e3 * self.server_cpu_s / max(self.requests, 1):.3f} ms/request  "
                f"(load average {load_average():.1f})")


def capacity(root, paths: list[str], requests: int, threads: int, first_byte_ms: float) -> str:
    with ObjectStore(root, first_byte_ms=first_byte_ms) as store:
        fetch = HttpFetch([store.url(path) for path in paths])
        with Measured(store) as run, ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda i: fetch(i % len(paths)), range(requests)))
    ideal = f"ideal {threads / (first_byte_ms / 1e3):.0f}/s" if first_byte_ms else "no emulated latency"
    return run.line(f"(0) {threads} threads, {first_byte_ms:g} ms ({ideal})", requests, "requests")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--first-byte-ms", type=float, default=10.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--image-px", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--client-threads", type=int, default=8)
    parser.add_argument("--capacity-requests", type=int, default=2000)
    parser.add_argument("--target", type=float, default=3.0, help="Daft over PIL images/s to reach (exit 1 below)")
    args = parser.parse_args()
    print(describe_machine())
    ds = dataset.generate(args.images)
    paths, labels = ds.paths_and_labels()
    print(f"{len(paths)} JPEGs, {sum(os.path.getsize(p) for p in paths) / len(paths) / 1e3:.1f} KB on average; "
          f"first_byte_ms={args.first_byte_ms:g} (EMULATED), {args.workers} DataLoader workers")
    for first_byte_ms in (args.first_byte_ms, 0.0):
        print(capacity(ds.root, paths, args.capacity_requests, args.client_threads, first_byte_ms))

    dataengine.use_native_runner()
    runs = {}
    with ObjectStore(ds.root, first_byte_ms=args.first_byte_ms) as store:
        labels_of = {"PIL DataLoader": f"(a) PIL DataLoader, {args.workers} workers",
                     "PIL DataLoader + GET threads": f"(b) the same, {store_race.GET_THREADS} GET threads a worker",
                     "Daft pipeline": "(c) Daft download + decode + resize"}
        for loader, label in labels_of.items():
            with Measured(store) as measured:
                runs[loader] = store_race.measure(store, loader, paths, labels, workers=args.workers,
                                                  image_px=args.image_px, batch_size=args.batch_size)
            print(measured.line(label, runs[loader].images, "images") + f", {runs[loader].connections} connections")
    pil_images, daft_images = (runs[loader].images for loader in ("PIL DataLoader", "Daft pipeline"))
    ratio = runs["Daft pipeline"].images_per_s / runs["PIL DataLoader"].images_per_s
    met = ratio >= args.target and pil_images == daft_images == len(paths)
    print(f"Daft / PIL images/s: {ratio:.2f}x (target >= {args.target:g}x, both {len(paths)} images): "
          f"{'met' if met else 'NOT met'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
