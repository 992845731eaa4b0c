"""Lab 1's PIL DataLoader and Lab 2's Daft pipeline reading the same images from the object store.

A DataLoader worker fetches an object, decodes it, then fetches the next: one
request in flight per worker, so at a first-byte latency of L ms the loader
cannot beat ``workers / L`` images/s however fast it decodes. Daft's
``download()`` keeps many requests in flight from native threads, so the latency
overlaps and what is left is the decode. The same DataLoader with
:data:`GET_THREADS` threads of GETs in each worker keeps as many in flight as
Daft does: :func:`race` measures the three with the store's latency off and on,
taking turns, and reads from the server's log how many requests each made, over
how many connections (client ports), and how many were in flight on average
(each request's wait from arrival to answer, summed, over the pass: Little's L).

The latency is an EMULATED condition (:mod:`labkit.objectstore`); the images/s,
the requests, the connections and the requests in flight are measured.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import daft
import torch
from matplotlib.figure import Figure

from labkit import dataengine, loaders, plots, representations
from labkit.objectstore import HttpFetch, ObjectStore

LOADERS = ("PIL DataLoader", "PIL DataLoader + GET threads", "Daft pipeline")

GET_THREADS = 8
"""GET threads per DataLoader worker in the race's threaded loader.

To stay decode-bound a worker needs about latency / decode requests in flight
(10 ms over ~1.6 ms to decode an image here: 6-7); 8 leaves some over. Daft's
native threads kept about 9 in flight from the whole process in the same race.
"""


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
    in_flight: float
    """Requests the server held at once on average: each GET's wait for its answer, summed, over the pass."""

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds

    def as_row(self) -> dict[str, object]:
        return {"loader": self.loader, "latency_ms": self.latency_ms, "images": self.images,
                "images_per_s": round(self.images_per_s), "requests": self.requests,
                "connections": self.connections, "in_flight": round(self.in_flight, 1)}

    def little_bound(self) -> float:
        """Images/s by Little's law from the requests in flight counted in the server's log, over ``latency_ms``.

        Not a prediction: ``in_flight`` is measured, so ``images_per_s / little_bound()``
        is ``latency_ms`` over the mean time a request waited in the server. Near 1,
        each request waited about the set latency: the rate is set by the requests in
        flight, not by the server; below 1, the server took longer than the latency.
        """
        if self.latency_ms <= 0:
            raise ValueError("with no latency a request costs no time: no bound")
        return self.in_flight * 1e3 / self.latency_ms


@dataclass(frozen=True)
class Race:
    """Both loaders at latency 0 and at ``latency_ms``, each one's best round."""

    runs: dict[tuple[str, float], StoreRun]
    latency_ms: float
    workers: int

    def run(self, loader: str, latency_ms: float) -> StoreRun:
        return self.runs[(loader, latency_ms)]

    def speedup(self, loader: str = "Daft pipeline", over: str = "PIL DataLoader") -> float:
        """``loader``'s images/s over ``over``'s, both at ``latency_ms``."""
        return self.run(loader, self.latency_ms).images_per_s / self.run(over, self.latency_ms).images_per_s

    def kept(self, loader: str) -> float:
        """The share of its no-latency images/s that ``loader`` keeps at ``latency_ms``."""
        return self.run(loader, self.latency_ms).images_per_s / self.run(loader, 0.0).images_per_s

    def little_bound(self) -> float:
        """The most images/s ``workers`` requests in flight can bring at ``latency_ms`` (Little's law)."""
        return self.workers * 1e3 / self.latency_ms

    def plot(self, title: str) -> Figure:
        """Left: each loader's images/s with the latency off and on. Right: images/s against requests in flight."""
        colours = dict(zip(LOADERS, (plots.BASELINE, plots.GOOD, plots.FIX)))
        fig, (rates, little) = plots.figure(2, width=12, height=4)
        plots.grouped_bars(rates, ["no latency", f"{self.latency_ms:g} ms first byte"],
                           {loader: [self.run(loader, ms).images_per_s for ms in (0.0, self.latency_ms)]
                            for loader in LOADERS}, colors=list(colours.values()), fmt="{:.0f}",
                           ylabel="images/s", title=title)
        rates.set_ylim(0, 1.4 * max(run.images_per_s for run in self.runs.values()))
        rates.legend(fontsize=8, loc="upper center", ncol=2)
        runs = [self.run(loader, self.latency_ms) for loader in LOADERS]
        most = 1.2 * max(run.in_flight for run in runs)
        little.plot([0, most], [0, most * 1e3 / self.latency_ms], "k--",
                    label=f"Little's law: in flight (from the log) / {self.latency_ms:g} ms")
        decode_bound = max(self.run(loader, 0.0).images_per_s for loader in LOADERS)
        little.axhline(decode_bound, color=plots.BASELINE, linestyle=":",
                       label="measured: fastest rate with no latency (the decode)")
        for run in runs:
            little.plot(run.in_flight, run.images_per_s, "o", markersize=9, color=colours[run.loader],
                        label=f"measured: {run.loader}")
        little.set_xlabel("requests in flight at the store (mean, from its log)")
        little.set_ylabel("images/s")
        little.set_ylim(0, 1.3 * decode_bound)
        little.set_title(f"at {self.latency_ms:g} ms first byte")
        little.legend(fontsize=8)
        fig.tight_layout()
        return fig


def _batches(loader: str, urls: list[str], labels: Sequence[int], *, workers: int, image_px: int,
             batch_size: int, get_threads: int = GET_THREADS) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    if loader != "Daft pipeline":
        threads = get_threads if loader == "PIL DataLoader + GET threads" else 1
        return iter(loaders.fetched_loader(HttpFetch(urls), labels, batch_size=batch_size, image_px=image_px,
                                           num_workers=workers, augment=False, get_threads=threads))
    frame = daft.from_pydict({"path": urls, "label": list(labels)})
    return representations.file_batches(frame, image_px, batch_size)


def measure(store: ObjectStore, loader: str, paths: Sequence[str], labels: Sequence[int], *, workers: int,
            image_px: int, batch_size: int, get_threads: int = GET_THREADS) -> StoreRun:
    """Drain ``loader`` over ``paths`` served by ``store``; requests and connections from the server's log.

    ``get_threads``: GET threads per worker of ``"PIL DataLoader + GET threads"``.
    """
    if loader not in LOADERS:
        raise ValueError(f"loader must be one of {LOADERS}, got {loader!r}")
    before = len(store.log())
    start = time.perf_counter()
    images, _ = dataengine.drain(_batches(loader, [store.url(path) for path in paths], labels, workers=workers,
                                          image_px=image_px, batch_size=batch_size, get_threads=get_threads))
    seconds = time.perf_counter() - start
    served = [record for record in store.log()[before:] if record["method"] == "GET"]
    waited_s = sum(record["time_s"] - record["arrived_s"] for record in served)
    return StoreRun(loader, store.first_byte_ms, images, seconds, len(served),
                    len({record["client_port"] for record in served}), waited_s / seconds)


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
