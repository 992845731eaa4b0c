"""Restoring a checkpoint: from the copy the async saver keeps in memory, or from remote storage.

The async saver (:class:`labkit.savers.AsyncSaver`) first copies the training state
into host memory, then writes it out. Once the write is committed that copy is
still there: a trainer restarted in the same process restores from it at memory
speed, while a replacement that has only the store fetches the whole checkpoint
first. Singh's talk proposes restore caches built on this idea, with peers keeping
each other's copies; what is measured here is the local half of it.

The store is :mod:`labkit.objectstore`'s server over the checkpoint folder. Its
first-byte latency and its read rate are EMULATED conditions (one stream from a
remote bucket); the restore times are measured, and the store's is printed beside
the model first byte + bytes / rate + the in-memory restore's own time.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from labkit import checkpoint, savers
from labkit.checkpoint_stalls import make_model, train_step
from labkit.crashcheck import same_bits
from labkit.devices import synchronize
from labkit.objectstore import HttpFetch, ObjectStore

STORE_BYTES_PER_S = 100e6
"""The emulated read rate of the store: about what one stream from a remote object store delivers."""
STORE_FIRST_BYTE_MS = 20.0
"""The emulated first-byte latency of the store for a large object."""


@dataclass(frozen=True)
class Restore:
    """One restore of the newest checkpoint into a freshly built trainer."""

    source: str
    seconds: float
    bytes: int
    identical: bool
    """Every tensor of model and optimizer equal to the saved state's, bit for bit."""


@dataclass(frozen=True)
class RestoreRace:
    memory: Restore
    store: Restore
    bytes_per_s: float
    first_byte_ms: float

    def speedup(self) -> float:
        """How many times faster the in-memory copy restores than the store."""
        return self.store.seconds / self.memory.seconds

    def modelled_store_s(self) -> float:
        """First byte + bytes / rate (both emulated conditions) + the in-memory restore's measured time."""
        return self.first_byte_ms / 1e3 + self.store.bytes / self.bytes_per_s + self.memory.seconds

    def store_vs_model(self) -> float:
        return self.store.seconds / self.modelled_store_s()


def restore_race(directory: str | Path, *, state_mb: float, device: str | torch.device = "cpu",
                 bytes_per_s: float = STORE_BYTES_PER_S, first_byte_ms: float = STORE_FIRST_BYTE_MS,
                 rounds: int = 3) -> RestoreRace:
    """Train two steps, save with the async saver, then restore the save both ways, ``rounds`` times each.

    Each restore builds a new model and optimizer (another seed, so a restore that
    skipped a tensor shows) and times fetching plus loading the state into them;
    each source keeps its fastest round.
    """
    if rounds < 1 or state_mb <= 0 or bytes_per_s <= 0:
        raise ValueError(f"rounds >= 1, state_mb > 0 and bytes_per_s > 0 are needed, got {rounds}, {state_mb}, "
                         f"{bytes_per_s}")
    device = torch.device(device)
    model, optimizer = make_model(state_mb, device=device)
    for step in (1, 2):
        train_step(model, optimizer, step, device)
    saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}   # this trainer trains no further
    with savers.AsyncSaver(directory, keep=1) as saver:
        saver.save(2, checkpoint.capture_training_state(model, optimizer, loader_position=2))
        stats = saver.wait()
        snapshot = saver.in_memory()
        key = (stats.path / checkpoint.STATE_FILE).relative_to(Path(directory).resolve())
        with ObjectStore(directory, first_byte_ms=first_byte_ms, bytes_per_s=bytes_per_s) as store:
            sources = _sources(snapshot, HttpFetch([store.url(key)]))
            best: dict[str, Restore] = {}
            for _ in range(rounds):
                for source, load in sources.items():
                    restored = _restore(source, load, state_mb, device, saved, stats.bytes)
                    if source not in best or restored.seconds < best[source].seconds:
                        best[source] = restored
    return RestoreRace(best["memory"], best["store"], bytes_per_s, first_byte_ms)


def _sources(snapshot: dict, fetch: HttpFetch) -> dict[str, Callable[[], dict]]:
    """How each source hands over the state: the snapshot itself, or the checkpoint file fetched and unpickled."""
    return {"memory": lambda: snapshot,
            "store": lambda: torch.load(io.BytesIO(fetch(0)), map_location="cpu", weights_only=True)}


def _restore(source: str, load: Callable[[], dict], state_mb: float, device: torch.device, saved: dict,
             nbytes: int) -> Restore:
    model, optimizer = make_model(state_mb, device=device, seed=1)
    start = time.perf_counter()
    checkpoint.restore_training_state(load(), model, optimizer)
    synchronize(device)
    seconds = time.perf_counter() - start
    restored = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    return Restore(source, seconds, nbytes, same_bits(saved, restored))
