"""Lab 1's exercises: requests to the store, a deterministic flip rule, the transformed cache's size."""

from __future__ import annotations

import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from labkit import ladder, loaders, objectstore
from labkit.exercises import Verdict, check_code, predict

FlipRule = Callable[[int, int, int], bool]


def store_requests(run: ladder.Ladder, prediction, *, images: int = 64, epochs: int = 2) -> Verdict | None:
    """Exercise 1.1: GETs for ``epochs`` of remote reads over ``images`` objects, then a raw cache of them
    trained for as many epochs. Counted by the store's own log."""
    def measure() -> float:
        with run._store() as store:
            fetch = objectstore.HttpFetch([store.url(path) for path in run.paths[:images]])
            for epoch in range(epochs):
                _drain(loaders.fetched_loader(fetch, run.labels[:images], batch_size=32, epoch=epoch,
                                              image_px=run.sizes.image_px, num_workers=run.sizes.workers))
            cache = loaders.RawCache.fill(fetch, images)
            for epoch in range(epochs):
                _drain(cache.loader(run.labels[:images], batch_size=32, epoch=epoch, num_workers=0,
                                    image_px=run.sizes.image_px))
            return store.requests("GET")

    return predict("1.1", prediction, what=f"the GETs the store logs for {epochs} remote epochs over {images} "
                   f"images plus a raw cache of them trained {epochs} epochs", measure=measure,
                   context=(images, epochs), tolerance=0.0, unit="GETs",
                   explain=lambda got: f"Remote reads cost one GET per image per epoch ({epochs} x {images}); the raw "
                                       f"cache costs one per image once ({images}), however long it trains.")


def flip_rule(run: ladder.Ladder, answer, *, images: int = 256, batch_size: int = 32) -> bool | None:
    """Exercise 1.2: a flip rule ``(seed, epoch, index) -> bool`` whose batches do not depend on the workers."""
    def test(rule: FlipRule) -> str | None:
        flips = np.array([bool(rule(0, 0, i)) for i in range(images)])
        if not 0.3 < flips.mean() < 0.7:
            return f"it flips {flips.mean():.0%} of the images; about half is the point of a random flip"
        if np.mean(flips != [bool(rule(0, 1, i)) for i in range(images)]) < 0.2:
            return "epoch 1 flips almost the same images as epoch 0: the rule should depend on the epoch"
        if not np.array_equal(flips, [bool(rule(0, 0, i)) for i in range(images)]):
            return "asked twice about the same image, it answered differently"
        with _flips_by(rule):
            digests = {w: ladder.deterministic_batches(run.paths[:images], run.labels[:images],
                                                       batch_size=batch_size, workers=w)
                       for w in (0, 1, 2)}
        if not digests[0] == digests[1] == digests[2]:
            return "the pixels of a batch change with the number of loader workers"
        return None

    return check_code("1.2", answer, what="a function flip(seed, epoch, index) -> bool", test=test)


def cache_bytes(run: ladder.Ladder, prediction, *, images: int = 256, image_px: int = 48) -> Verdict | None:
    """Exercise 1.3: the transformed cache's size on disk at another resolution."""
    def measure() -> float:
        with tempfile.TemporaryDirectory(prefix="labkit-exercise-") as folder:
            cache = loaders.TransformedCache.build(run.paths[:images], run.labels[:images],
                                                   Path(folder) / "cache.npy", image_px=image_px)
            return cache.nbytes

    def explain(measured: float) -> str:
        pixels = images * 3 * image_px ** 2
        return (f"{images} images x 3 channels x {image_px}^2 pixels = {pixels:,} bytes of uint8; the .npy "
                f"header adds {measured - pixels:,.0f}. The JPEGs' size does not enter: the cache holds pixels.")

    return predict("1.3", prediction, what=f"the bytes of a transformed cache of {images} images at {image_px} px",
                   measure=measure, context=(run, images, image_px), tolerance=0.01, unit="bytes", explain=explain)


def _drain(batches) -> None:
    for _ in batches:
        pass


@contextmanager
def _flips_by(rule: FlipRule) -> Iterator[None]:
    """Have labkit's loader flip by ``rule``; forked loader workers inherit it."""
    before = loaders.flip_decision
    loaders.flip_decision = rule
    try:
        yield
    finally:
        loaders.flip_decision = before
