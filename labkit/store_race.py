"""Lab 1's PIL DataLoader and Lab 2's Daft pipeline reading the same images from the object store.

A DataLoader worker fetches an object, decodes it, then fetches the next: one
request in flight per worker, so at a first-byte latency of L ms the loader
cannot beat ``workers / L`` images/s however fast it decodes. Daft's
``download()`` keeps many requests in flight from native threads, so the latency
overlaps and what is left is the decode. :func:`race` measures both loaders with
the store's latency off and on, taking turns, and reads from the server's log how
many requests each made and over how many connections (client ports).

The latency is an EMULATED condition (:mod:`labkit.objectstore`); the images/s,
the requests and the connections are measured.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import daft
import torch

from labkit import dataengine, loaders, representations
from labkit.objectstore import HttpFetch, ObjectStore

LOADERS = ("PIL DataLoader", "Daft pipeline")


@dataclass(frozen=True)
class StoreRun:
    """One loader's pass over the images from a store at one first-byte latency."""

    loader: str
    latency_ms: float
    images: int
    seconds: float
    requests: int
    """GETs the server logged during the pass."""
    connections: int
    """Distinct client ports among those GETs: connections the loader opened."""

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds

    def as_row(self) -> dict[str, object]:
        return {"loader": self.loader, "latency_ms": self.latency_ms, "images": self.images,
                "images_per_s": round(self.images_per_s), "requests": self.requests,
                "connections": self.connections}


@dataclass(frozen=True)
class Race:
    """Both loaders at latency 0 and at ``latency_ms``, each one's best round."""

    runs: dict[tuple[str, float], StoreRun]
    latency_ms: float
    workers: int

    def run(self, loader: str, latency_ms: float) -> StoreRun:
        return self.runs[(loader, latency_ms)]

    def speedup(self) -> float:
        """Daft's images/s over the DataLoader's, both at ``latency_ms``."""
        return (self.run("Daft pipeline", self.latency_ms).images_per_s
                / self.run("PIL DataLoader", self.latency_ms).images_per_s)

    def kept(self, loader: str) -> float:
        """The share of its no-latency images/s that ``loader`` keeps at ``latency_ms``."""
        return self.run(loader, self.latency_ms).images_per_s / self.run(loader, 0.0).images_per_s

    def little_bound(self) -> float:
        """The most images/s ``workers`` requests in flight can bring at ``latency_ms`` (Little's law)."""
        return self.workers * 1e3 / self.latency_ms


def _batches(loader: str, urls: list[str], labels: Sequence[int], *, workers: int, image_px: int,
             batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    if loader == "PIL DataLoader":
        return iter(loaders.fetched_loader(HttpFetch(urls), labels, batch_size=batch_size, image_px=image_px,
                                           num_workers=workers, augment=False))
    frame = daft.from_pydict({"path": urls, "label": list(labels)})
    return representations.file_batches(frame, image_px, batch_size)


def measure(store: ObjectStore, loader: str, paths: Sequence[str], labels: Sequence[int], *, workers: int,
            image_px: int, batch_size: int) -> StoreRun:
    """Drain ``loader`` over ``paths`` served by ``store``; requests and connections from the server's log."""
    if loader not in LOADERS:
        raise ValueError(f"loader must be one of {LOADERS}, got {loader!r}")
    before = len(store.log())
    start = time.perf_counter()
    images, _ = dataengine.drain(_batches(loader, [store.url(path) for path in paths], labels, workers=workers,
                                          image_px=image_px, batch_size=batch_size))
    seconds = time.perf_counter() - start
    served = [record for record in store.log()[before:] if record["method"] == "GET"]
    return StoreRun(loader, store.first_byte_ms, images, seconds, len(served),
                    len({record["client_port"] for record in served}))


def race(root: str | Path, paths: Sequence[str], labels: Sequence[int], *, latency_ms: float, workers: int,
         image_px: int, batch_size: int, rounds: int = 2) -> Race:
    """Both loaders over the same objects, at no latency and at ``latency_ms``, ``rounds`` times in turn.

    Each (loader, latency) keeps its fastest round: the first pass of a process pays
    start-up (Daft's runtime, the workers' imports) that a training epoch does not.
    """
    dataengine.check_positive(workers=workers, image_px=image_px, batch_size=batch_size, rounds=rounds)
    if not paths:
        raise ValueError("paths must name at least one object in the store, got none")
    if not latency_ms > 0:
        raise ValueError(f"latency_ms must be > 0 (the race compares it with no latency), got {latency_ms}")
    if len(labels) != len(paths):
        raise ValueError(f"labels must have one entry per path: {len(labels)} labels for {len(paths)} paths")
    best: dict[tuple[str, float], StoreRun] = {}
    for _ in range(rounds):
        for first_byte_ms in (0.0, latency_ms):
            with ObjectStore(root, first_byte_ms=first_byte_ms) as store:
                for loader in LOADERS:
                    run = measure(store, loader, paths, labels, workers=workers, image_px=image_px,
                                  batch_size=batch_size)
                    key = (loader, first_byte_ms)
                    if key not in best or run.seconds < best[key].seconds:
                        best[key] = run
    return Race(best, latency_ms, workers)
