"""Checkpoints that do not stop the world, and that a crash cannot tear.

A synchronous save (:class:`SyncSaver`, the baseline) makes every training step
wait for serialisation, the disk and ``fsync``. The two-phase save
(:class:`AsyncSaver`) only waits for a copy of the state into host memory
(pinned on a GPU so the device-to-host copy is a fast DMA), then returns to
training while a background thread streams that copy to storage. At most one save
is in flight: the next save first waits for the previous write, which bounds the
extra host memory to one copy of the state (the cost the DCP recipe warns about).

Both savers commit the same way, the way databases do::

    step-000000120/state.pt        temporary file -> fsync -> rename
    step-000000120/manifest.json   sizes + CRC-32 checksums, written last (the commit point)

A checkpoint without a manifest, or whose files do not match it, is not a
checkpoint: :func:`load_latest` skips it with a warning and falls back to the
previous one. A process killed at any instant therefore leaves either the new
checkpoint complete or the previous one in charge. Pruning to the last ``keep``
checkpoints deletes the manifest first for the same reason. A *committed*
checkpoint that cannot be used -- another format version, or content that
``torch.load(weights_only=True)`` refuses -- is no crash's doing, and falling back
would silently throw away its progress: that raises :class:`CheckpointError`.
Savers refuse such content before it reaches the disk (:func:`check_loadable`).

:func:`capture_training_state` / :func:`restore_training_state` cover everything
a resumed run needs to continue bit-identically on the CPU: model, optimizer, the
Python / NumPy / torch (CPU and CUDA) random generators and the loader position.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import threading
import time
import warnings
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from labkit.atomic import atomic_file, fsync_dir, remove_stale_temporaries, write_bytes_atomic

STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1
_STEP_PREFIX = "step-"
_CHUNK_BYTES = 8 << 20
_PLAIN_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.Size, torch.dtype, torch.device)
_CONTAINER_TYPES = (dict, OrderedDict, list, tuple, set)
ALLOWED_TYPES = "int, float, str, bool, None, bytes, torch tensors, and lists, tuples, sets or dicts of them"


class CheckpointError(RuntimeError):
    """A committed checkpoint that cannot be used; falling back would lose its progress."""


@dataclass(frozen=True)
class SaveStats:
    """What one save cost.

    ``blocked_s`` is the time training waited; ``total_s`` runs from the call to
    the commit (``nan`` while an async write is still in flight). ``bytes`` is the
    size of the committed state file (the snapshot size while in flight).
    ``started_s`` / ``committed_s`` are ``time.perf_counter()`` stamps for timelines.
    """

    step: int
    blocked_s: float
    total_s: float
    bytes: int
    path: Path
    started_s: float = 0.0
    committed_s: float = float("nan")
    staged_bytes: int = 0


@dataclass(frozen=True)
class Checkpoint:
    step: int
    state: dict
    path: Path


def step_dir(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"{_STEP_PREFIX}{step:09d}"


def check_loadable(value: Any, where: str = "state") -> None:
    """Raise ValueError if ``value`` holds anything ``torch.load(weights_only=True)`` refuses.

    Checkpoints are loaded that way so that loading cannot run code. A value it
    refuses (a numpy scalar is the usual culprit) makes the checkpoint unloadable,
    and nobody finds out until the restart that needs it. Types are matched
    exactly: ``np.float64`` subclasses ``float`` but pickles as numpy. The walk
    touches no tensor data, so it costs microseconds per thousand entries.
    """
    kind = type(value)
    if isinstance(value, torch.Tensor) or kind in _PLAIN_TYPES:
        return
    if kind in (dict, OrderedDict):
        for key, item in value.items():
            check_loadable(key, f"a key of {where}")
            check_loadable(item, f"{where}[{key!r}]")
        return
    if kind in _CONTAINER_TYPES:
        for index, item in enumerate(value):
            check_loadable(item, f"{where}[{index}]")
        return
    fix = "convert it to a plain Python value"
    if kind.__module__.split(".")[0] == "numpy":
        fix = "convert numpy scalars with .item() and arrays with torch.from_numpy"
    raise ValueError(
        f"{where} is a {kind.__module__}.{kind.__qualname__}, which torch.load(weights_only=True) "
        f"refuses, so the checkpoint could never be loaded; {fix}. Allowed: {ALLOWED_TYPES}"
    )


def _check_args(step: int, state: Any) -> None:
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if not isinstance(state, dict):
        raise ValueError(f"state must be a dict, got {type(state).__name__}")
    check_loadable(state)


def _check_keep(keep: int) -> None:
    if not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an int >= 1, got {keep!r}")


class _ChecksummingWriter:
    """A file object that computes size and CRC-32 while torch.save streams through it.

    CRC-32 (zlib, ~1.5 GB/s, releases the GIL) catches torn and corrupted files;
    it is not a defence against deliberate tampering.
    """

    def __init__(self, handle: BinaryIO):
        self.handle = handle
        self.crc32 = 0
        self.bytes = 0

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data)
        self.crc32 = zlib.crc32(view, self.crc32)
        self.bytes += view.nbytes
        return self.handle.write(view)

    def flush(self) -> None:
        self.handle.flush()


def _file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
    return crc


def _uncommit(folder: Path) -> None:
    """Remove the commit point first, so a half-deleted folder is never accepted."""
    manifest = folder / MANIFEST_FILE
    if manifest.exists():
        manifest.unlink()
        fsync_dir(folder)


def write_checkpoint(directory: str | Path, step: int, state: dict) -> tuple[Path, int]:
    """Write ``state`` as checkpoint ``step`` and commit it; returns (folder, bytes).

    Order matters: state file via temporary + fsync + rename, then the manifest
    (itself atomic). Rewriting an existing step un-commits it first. A state that
    could not be loaded back is refused before anything is written.
    """
    check_loadable(state)
    directory = Path(directory)
    folder = step_dir(directory, step)
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    if created:
        fsync_dir(directory)
    _uncommit(folder)
    with atomic_file(folder / STATE_FILE) as tmp:
        with open(tmp, "wb") as handle:
            writer = _ChecksummingWriter(handle)
            torch.save(state, writer)
    manifest = {
        "format": FORMAT_VERSION,
        "step": step,
        "files": {STATE_FILE: {"bytes": writer.bytes, "crc32": writer.crc32}},
        "written_unix_s": time.time(),
    }
    write_bytes_atomic(folder / MANIFEST_FILE, json.dumps(manifest, indent=1).encode())
    return folder, writer.bytes


def _step_of(folder: Path) -> int | None:
    suffix = folder.name[len(_STEP_PREFIX):]
    return int(suffix) if folder.name.startswith(_STEP_PREFIX) and suffix.isdigit() else None


def list_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """Every step folder (committed or not), newest first."""
    directory = Path(directory)
    if not directory.exists():
        return []
    found = [(_step_of(p), p) for p in directory.iterdir() if p.is_dir()]
    return sorted(((s, p) for s, p in found if s is not None), reverse=True)


def _check_format(folder: Path, manifest: dict) -> None:
    found = manifest.get("format")
    if found == FORMAT_VERSION:
        return
    what = "no format version in its manifest" if found is None else f"format {found!r}"
    raise CheckpointError(
        f"{folder}: {what}, but this labkit reads format {FORMAT_VERSION}. Load it with the labkit "
        f"that wrote it, or move the folder out of {folder.parent} to resume from an older checkpoint"
    )


def verify(folder: str | Path) -> str | None:
    """``None`` if ``folder`` is a complete checkpoint, else why it is not.

    Raises :class:`CheckpointError` for a committed checkpoint of another format
    version: that is not damage to skip but a mismatch to fix. The manifest is
    written atomically, so one that parses is a real commit.
    """
    folder = Path(folder)
    manifest_path = folder / MANIFEST_FILE
    if not manifest_path.exists():
        return "no manifest (the save never committed)"
    try:
        manifest = json.loads(manifest_path.read_text())
        if not isinstance(manifest, dict):
            raise TypeError(f"a JSON {type(manifest).__name__}, not an object")
        _check_format(folder, manifest)
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as exc:
        return f"unreadable manifest ({exc})"
    if manifest.get("step") != _step_of(folder):
        return f"manifest step {manifest.get('step')!r} does not match the folder name"
    for name, expected in files.items():
        path = folder / name
        if not path.exists():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != expected["bytes"]:
            return f"{name} has {size} bytes, manifest says {expected['bytes']}"
        if _file_crc32(path) != expected["crc32"]:
            return f"{name} fails its CRC-32 checksum"
    return None


def _unloadable(folder: Path, exc: Exception) -> CheckpointError:
    text = str(exc).split("WeightsUnpickler error: ")[-1].strip()
    reason = text.splitlines()[0].split(". ")[0] if text else "no message"
    return CheckpointError(
        f"{folder}: {STATE_FILE} does not load with torch.load(weights_only=True) "
        f"({type(exc).__name__}: {reason}), yet it is committed and matches its checksum: whatever "
        f"wrote it saved something unloadable, and older checkpoints of the run likely hold the same. "
        f"Fix the writer (labkit.checkpoint.check_loadable names the bad value), or move the folder "
        f"aside to resume from an older checkpoint on purpose"
    )


def load_latest(directory: str | Path) -> Checkpoint | None:
    """The newest complete and verified checkpoint in ``directory``, or ``None``.

    Torn or corrupt checkpoints (what a crash or a bad disk leaves) are skipped
    with a warning; the previous one is returned instead. A committed checkpoint
    that verifies but cannot be used raises :class:`CheckpointError`: skipping it
    would silently discard progress. Loading never modifies the directory.
    """
    for step, folder in list_checkpoints(directory):
        problem = verify(folder)
        if problem is None:
            try:
                state = torch.load(folder / STATE_FILE, map_location="cpu", weights_only=True)
            except Exception as exc:  # noqa: BLE001 - classified just below
                problem = verify(folder)  # not None only if a concurrent prune removed it meanwhile
                if problem is None:
                    raise _unloadable(folder, exc) from exc
            else:
                return Checkpoint(step=step, state=state, path=folder)
        warnings.warn(f"skipping checkpoint {folder}: {problem}", RuntimeWarning, stacklevel=2)
    return None


def load_for_resume(directory: str | Path) -> Checkpoint | None:
    """What a restarted run resumes from: :func:`load_latest`, where ``None`` means
    that nothing was ever committed. If checkpoints were committed but none of them
    verifies, starting again from step 0 would silently throw the run away: raise.
    """
    latest = load_latest(directory)
    if latest is None:
        committed = [folder.name for _, folder in list_checkpoints(directory) if (folder / MANIFEST_FILE).exists()]
        if committed:
            raise CheckpointError(
                f"{directory} holds committed checkpoints {committed} but none of them verifies (see the "
                f"warnings above); refusing to restart from step 0. Restore them from a copy, or delete "
                f"{directory} to start the run over on purpose"
            )
    return latest


def prune(directory: str | Path, keep: int) -> list[Path]:
    """Keep the newest ``keep`` committed checkpoints; delete older ones and torn
    folders older than the newest commit. Returns the folders removed."""
    _check_keep(keep)
    removed: list[Path] = []
    committed = 0
    for _, folder in list_checkpoints(directory):
        is_committed = (folder / MANIFEST_FILE).exists()
        if is_committed and committed < keep:
            committed += 1
            continue
        if committed == 0:
            continue
        _uncommit(folder)
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


class _SaverBase:
    def __init__(self, directory: str | Path, *, keep: int = 3):
        _check_keep(keep)
        self.directory = Path(directory)
        self.keep = keep
        self.directory.mkdir(parents=True, exist_ok=True)
        for _, folder in list_checkpoints(self.directory):
            remove_stale_temporaries(folder)
        self.history: list[SaveStats] = []

    def _commit(self, step: int, state: dict) -> tuple[Path, int]:
        folder, nbytes = write_checkpoint(self.directory, step, state)
        prune(self.directory, self.keep)
        return folder, nbytes


class SyncSaver(_SaverBase):
    """The baseline: training waits for serialisation, the write and fsync."""

    def save(self, step: int, state: dict) -> SaveStats:
        _check_args(step, state)
        start = time.perf_counter()
        folder, nbytes = self._commit(step, state)
        end = time.perf_counter()
        stats = SaveStats(step, end - start, end - start, nbytes, folder, start, end, 0)
        self.history.append(stats)
        return stats

    def close(self) -> None:
        pass

    def __enter__(self) -> "SyncSaver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _walk_tensors(obj: Any, visit) -> Any:
    if isinstance(obj, torch.Tensor):
        return visit(obj)
    if isinstance(obj, dict):
        copied = type(obj)((k, _walk_tensors(v, visit)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):
            copied._metadata = obj._metadata
        return copied
    if isinstance(obj, list):
        return [_walk_tensors(v, visit) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_walk_tensors(v, visit) for v in obj)
    return obj


def state_bytes(state: Any) -> int:
    """Bytes held in the tensors of ``state`` (what a snapshot must copy)."""
    total = 0

    def count(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    _walk_tensors(state, count)
    return total


@dataclass
class _StagingArea:
    """Host buffers reused across snapshots: allocating (and, on a GPU, pinning)
    hundreds of MB on every save would cost more than the copy itself.

    The copy runs on one thread: it is bound by memory bandwidth, which one core
    nearly saturates, and a parallel copy stalls whenever another process holds
    one of the cores (measured here: ~5x slower under load than one thread)."""

    buffers: list[torch.Tensor] = field(default_factory=list)

    def snapshot(self, state: dict) -> dict:
        index = 0
        # Only GPU tensors need pinned buffers and a synchronize; asking CUDA on a CPU
        # rank of a GPU machine would start a CUDA context there for nothing. Each
        # device the state lives on has its own queue of copies: synchronising only
        # the current one could hand the writer a buffer another GPU is still filling.
        gpus: set[torch.device] = set()

        def copy(t: torch.Tensor) -> torch.Tensor:
            nonlocal index
            src = t.detach()
            if src.is_cuda:
                gpus.add(src.device)
            if index < len(self.buffers):
                buf = self.buffers[index]
                if buf.shape != src.shape or buf.dtype != src.dtype:
                    buf = self.buffers[index] = self._alloc(src)
            else:
                buf = self._alloc(src)
                self.buffers.append(buf)
            index += 1
            buf.copy_(src, non_blocking=src.is_cuda)
            return buf

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            staged = _walk_tensors(state, copy)
        finally:
            torch.set_num_threads(threads)
        del self.buffers[index:]
        for device in sorted(gpus, key=str):
            torch.cuda.synchronize(device)
        return staged

    @staticmethod
    def _alloc(src: torch.Tensor) -> torch.Tensor:
        return torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=src.is_cuda)

    @property
    def bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)


class AsyncSaver(_SaverBase):
    """Two-phase save: snapshot to host memory, return, write in the background.

    ``save`` blocks for (a) any previous write still in flight -- at most one save
    is outstanding, so host memory grows by one copy of the state, not more -- and
    (b) the copy into reused staging buffers. The write, fsync, commit and pruning
    run on a background thread. An error there is raised by the next call.
    """

    def __init__(self, directory: str | Path, *, keep: int = 3):
        super().__init__(directory, keep=keep)
        self._staging = _StagingArea()
        self._thread: threading.Thread | None = None
        self._pending: SaveStats | None = None
        self._result: SaveStats | None = None
        self._error: BaseException | None = None

    @property
    def staging_bytes(self) -> int:
        """Host memory held for snapshots (the price of not blocking)."""
        return self._staging.bytes

    def save(self, step: int, state: dict) -> SaveStats:
        _check_args(step, state)
        start = time.perf_counter()
        self.wait()
        staged = self._staging.snapshot(state)
        blocked = time.perf_counter() - start
        pending = SaveStats(
            step, blocked, float("nan"), state_bytes(staged),
            step_dir(self.directory, step), start, float("nan"), self._staging.bytes,
        )
        self._pending = pending
        self._thread = threading.Thread(
            target=self._write, args=(pending, staged), name=f"labkit-ckpt-{step}", daemon=True
        )
        self._thread.start()
        return pending

    def _write(self, pending: SaveStats, staged: dict) -> None:
        try:
            folder, nbytes = self._commit(pending.step, staged)
            end = time.perf_counter()
            self._result = replace(
                pending, total_s=end - pending.started_s, bytes=nbytes, path=folder, committed_s=end
            )
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread
            self._error = exc

    def wait(self) -> SaveStats | None:
        """Block until the in-flight write is committed; its final stats, or None."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        self._pending = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("background checkpoint write failed") from error
        result, self._result = self._result, None
        if result is not None:
            self.history.append(result)
        return result

    def close(self) -> None:
        """Commit the last save and release the staging memory."""
        try:
            self.wait()
        finally:
            self._staging.buffers.clear()

    def __enter__(self) -> "AsyncSaver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _numpy_rng_state() -> dict:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def _set_numpy_rng_state(saved: dict) -> None:
    keys = saved["keys"].numpy().astype(np.uint32)
    np.random.set_state((saved["kind"], keys, saved["pos"], saved["has_gauss"], saved["cached_gaussian"]))


def capture_training_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    loader_position: int,
    extra: dict | None = None,
) -> dict:
    """Everything a run needs to resume exactly where it stopped.

    Tensors are *references* to live state (cheap); the savers copy or serialise
    them. ``extra`` must hold plain data (:data:`ALLOWED_TYPES`): checkpoints are
    loaded with ``weights_only=True`` so that loading cannot run code, and a value
    that load would refuse is rejected here, naming its key, rather than at the restart.
    """
    if not isinstance(loader_position, int) or loader_position < 0:
        raise ValueError(f"loader_position must be an int >= 0, got {loader_position!r}")
    extra = dict(extra or {})
    check_loadable(extra, "extra")
    rng = {
        "python": random.getstate(),
        "numpy": _numpy_rng_state(),
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_initialized():  # a CPU rank on a GPU machine has no CUDA RNG in use
        rng["torch_cuda"] = torch.cuda.get_rng_state_all()
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": rng,
        "loader_position": loader_position,
        "extra": extra,
    }


def restore_training_state(state: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Restore model, optimizer and every RNG from ``state``; returns the loader position."""
    missing = {"model", "optimizer", "rng", "loader_position"} - set(state)
    if missing:
        raise ValueError(f"state is missing {sorted(missing)}; was it made by capture_training_state?")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    rng = state["rng"]
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    _set_numpy_rng_state(rng["numpy"])
    torch.set_rng_state(rng["torch_cpu"])
    if "torch_cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["torch_cuda"])
    return int(state["loader_position"])


# --- Experiments: real training loops that checkpoint every k steps -------------

SIZES = {
    "ci": {"state_mb": 64, "steps": 12, "save_every": 4, "dcp_state_mb_per_rank": 48, "dcp_saves": 3},
    "gpu": {"state_mb": 512, "steps": 60, "save_every": 10, "dcp_state_mb_per_rank": 256, "dcp_saves": 4},
    "multi-gpu": {"state_mb": 1024, "steps": 60, "save_every": 10, "dcp_state_mb_per_rank": 512, "dcp_saves": 4},
}
_WIDTH = 1024
_BYTES_PER_PARAM_WITH_ADAM = 12


def make_model(state_mb: float, *, device: str | torch.device = "cpu", seed: int = 0):
    """An MLP plus Adam whose checkpoint (weights + two moments, fp32) is about
    at least ``state_mb`` MB: the size, not the architecture, is what a save pays for."""
    if state_mb <= 0:
        raise ValueError(f"state_mb must be > 0, got {state_mb}")
    layers = max(1, math.ceil(state_mb * 1e6 / _BYTES_PER_PARAM_WITH_ADAM / (_WIDTH * _WIDTH + _WIDTH)))
    torch.manual_seed(seed)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(_WIDTH, _WIDTH), torch.nn.GELU()]
    blocks.append(torch.nn.Dropout(0.1))
    model = torch.nn.Sequential(*blocks).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    return model, optimizer


def _train_step(model, optimizer, position: int, device, batch: int = 32) -> float:
    gen = torch.Generator().manual_seed(position)
    x = torch.randn(batch, _WIDTH, generator=gen).to(device)
    target = torch.randn(batch, _WIDTH, generator=gen).to(device)
    loss = torch.nn.functional.mse_loss(model(x), target)
    optimizer.zero_grad(set_to_none=False)
    loss.backward()
    optimizer.step()
    return loss.item()


class _PeakRss:
    """Peak resident memory added during a block, from the kernel's own high-water
    mark (``VmHWM``, reset through ``/proc/self/clear_refs``): exact, no sampling."""

    def __enter__(self) -> "_PeakRss":
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        self.start_bytes = self._field("VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        self.added_bytes = max(0, self._field("VmHWM") - self.start_bytes)

    @staticmethod
    def _field(name: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"{name} not in /proc/self/status")


@dataclass(frozen=True)
class TrainingRun:
    """One checkpointed training run. Times are seconds; ``*_spans`` are
    (start, duration) pairs relative to the run's start, for timelines.
    ``wall_s`` ends with the last step; ``drain_s`` is the wait for the last
    async write to commit after it (a cost paid once per run, not per save)."""

    kind: str
    steps: int
    save_every: int
    state_bytes: int
    wall_s: float
    drain_s: float
    compute_s: float
    saves: list[SaveStats]
    step_spans: list[tuple[float, float]]
    blocked_spans: list[tuple[float, float]]
    write_spans: list[tuple[float, float]]
    peak_rss_added_bytes: int
    losses: list[float]

    @property
    def useful_s(self) -> float:
        """Every step at this run's median step time: what the steps cost undisturbed.

        A step slowed by the background writer counts only its undisturbed part.
        """
        durations = sorted(d for _, d in self.step_spans)
        return len(durations) * durations[len(durations) // 2]

    @property
    def goodput(self) -> float:
        """:func:`labkit.interval.goodput` of this run, the final write (``drain_s``) included."""
        from labkit.interval import goodput

        return goodput(self.useful_s, self.wall_s + self.drain_s)

    @property
    def mean_blocked_s(self) -> float:
        """Mean seconds training stood still per save, timed around the save call by the loop."""
        return sum(d for _, d in self.blocked_spans) / max(1, len(self.blocked_spans))

    @property
    def mean_write_s(self) -> float:
        """Mean seconds a background write took after ``save`` returned (0 for a sync run).

        An async save that blocks for less than half of this has moved the write
        off the training loop; one that waits for its write blocks longer than it.
        """
        return sum(d for _, d in self.write_spans) / max(1, len(self.write_spans))

    @property
    def mean_total_s(self) -> float:
        return sum(s.total_s for s in self.saves) / max(1, len(self.saves))


SAVERS = {"sync": SyncSaver, "async": AsyncSaver}


def train_with_checkpoints(
    kind: str,
    directory: str | Path,
    *,
    state_mb: float,
    steps: int,
    save_every: int,
    device: str | torch.device = "cpu",
    keep: int = 2,
    progress: bool = False,
) -> TrainingRun:
    """Train ``steps`` steps, saving every ``save_every`` with ``kind`` in
    ``("none", "sync", "async")``, and record what each save cost training."""
    if kind not in ("none", *SAVERS):
        raise ValueError(f"kind must be 'none', 'sync' or 'async', got {kind!r}")
    if steps < 1 or save_every < 1:
        raise ValueError(f"steps and save_every must be >= 1, got {steps}, {save_every}")
    from labkit.devices import synchronize

    device = torch.device(device)
    model, optimizer = make_model(state_mb, device=device)
    _train_step(model, optimizer, 0, device)
    saver = SAVERS[kind](directory, keep=keep) if kind != "none" else None
    step_spans, blocked_spans, losses, saves = [], [], [], []
    iterator = range(1, steps + 1)
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(iterator, desc=f"{kind} checkpoints", leave=False)
    with _PeakRss() as rss:
        origin = time.perf_counter()
        for step in iterator:
            start = time.perf_counter()
            losses.append(_train_step(model, optimizer, step, device))
            synchronize(device)
            step_spans.append((start - origin, time.perf_counter() - start))
            if saver is not None and step % save_every == 0:
                # blocked time as training saw it: the call, including any wait for the previous save
                called = time.perf_counter()
                saver.save(step, capture_training_state(model, optimizer, loader_position=step))
                blocked_spans.append((called - origin, time.perf_counter() - called))
        wall_s = time.perf_counter() - origin
        drain_start = time.perf_counter()
        if saver is not None:
            saver.close()
            saves = list(saver.history)
        drain_s = time.perf_counter() - drain_start
    write_spans = [
        (s.started_s + s.blocked_s - origin, s.committed_s - s.started_s - s.blocked_s) for s in saves
    ]
    if kind == "sync":
        write_spans = []
    return TrainingRun(
        kind=kind, steps=steps, save_every=save_every,
        state_bytes=state_bytes(capture_training_state(model, optimizer, loader_position=0)),
        wall_s=wall_s, drain_s=drain_s, compute_s=sum(d for _, d in step_spans), saves=saves,
        step_spans=step_spans, blocked_spans=blocked_spans, write_spans=write_spans,
        peak_rss_added_bytes=rss.added_bytes, losses=losses,
    )


def resume_experiment(
    directory: str | Path, *, kind: str = "async", state_mb: float = 8, steps: int = 8, save_at: int = 4,
    device: str | torch.device = "cpu",
) -> tuple[list[float], list[float]]:
    """Losses after step ``save_at`` of an uninterrupted run, and of a run rebuilt
    from scratch (different init, disturbed RNGs) and resumed from the checkpoint.

    On ``device="cuda"`` the model's dropout draws from the CUDA generator, so the
    losses match only if the checkpoint restored that generator's state too.
    """
    if not 1 <= save_at < steps:
        raise ValueError(f"save_at must be in [1, steps), got {save_at} with steps={steps}")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} needs a CUDA GPU and this machine has none; use device='cpu'")
    model, optimizer = make_model(state_mb, device=device, seed=0)
    with SAVERS[kind](directory, keep=2) as saver:
        for step in range(1, save_at + 1):
            _train_step(model, optimizer, step, device)
        saver.save(save_at, capture_training_state(model, optimizer, loader_position=save_at))
    uninterrupted = [_train_step(model, optimizer, step, device) for step in range(save_at + 1, steps + 1)]

    model, optimizer = make_model(state_mb, device=device, seed=1)
    random.random(), np.random.rand(), torch.rand(3), torch.rand(3, device=device)
    position = restore_training_state(load_latest(directory).state, model, optimizer)
    resumed = [_train_step(model, optimizer, step, device) for step in range(position + 1, steps + 1)]
    return uninterrupted, resumed


def timeline_spans(run: TrainingRun) -> list[tuple[str, float, float, str]]:
    """Rows for ``labkit.plots.timeline`` (milliseconds): steps, blocked time, background writes."""
    from labkit.plots import BASELINE, FIX, WARN

    spans = [("training step", s * 1e3, d * 1e3, FIX) for s, d in run.step_spans]
    spans += [("training blocked by save", s * 1e3, d * 1e3, WARN) for s, d in run.blocked_spans]
    spans += [("background write", s * 1e3, d * 1e3, BASELINE) for s, d in run.write_spans]
    return spans


def _flat_rank_state(model, optimizer, rank: int) -> dict[str, torch.Tensor]:
    """Model and Adam moments under rank-unique keys: each rank owns its shard, so
    DCP writes every rank's tensors instead of de-duplicating them as replicas."""
    state = {f"rank{rank}/model/{k}": v for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for param, moments in optimizer.state.items():
        for key, value in moments.items():
            if torch.is_tensor(value) and value.dim() > 0:
                state[f"rank{rank}/optim/{names[id(param)]}/{key}"] = value
    return state


def compare_savers_rank(directory: str, state_mb_per_rank: float, saves: int, steps_between: int = 2) -> dict:
    """Rank function: the same shard saved by SyncSaver, AsyncSaver and DCP
    ``async_save`` (thread mode, its default) between real training steps.

    Before each timed save the previous one is drained and that wait is recorded
    apart (``waited_s``): ``blocked_s`` is then what the save call itself costs
    training, comparable across the three. The first call of each pays one-off
    set-up (allocating staging buffers; DCP's planning) and is reported as such.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if saves < 2:
        raise ValueError(f"saves must be >= 2 (the first call is set-up), got {saves}")
    rank = dist.get_rank()
    root = Path(directory)
    model, optimizer = make_model(state_mb_per_rank, seed=rank)
    position = 0
    _train_step(model, optimizer, position, "cpu")
    results: dict[str, Any] = {"rank": rank, "state_bytes": state_bytes(_flat_rank_state(model, optimizer, rank))}
    for kind in ("sync", "async", "dcp_async"):
        saver = SAVERS[kind](root / kind / f"rank{rank}", keep=2) if kind in SAVERS else None
        blocked, waited, total, future, done_at = [], [], [], None, {}
        dist.barrier()
        for index in range(saves):
            for _ in range(steps_between):
                position += 1
                _train_step(model, optimizer, position, "cpu")
            state = _flat_rank_state(model, optimizer, rank)
            drain = time.perf_counter()
            if isinstance(saver, AsyncSaver):
                saver.wait()
            elif future is not None:
                future.result()
            start = time.perf_counter()
            waited.append(start - drain)
            if saver is not None:
                blocked.append(saver.save(index, state).blocked_s)
            else:
                future = dcp.async_save(state, checkpoint_id=str(root / "dcp" / f"save{index}"))
                future.add_done_callback(
                    lambda _f, i=index, t0=start: done_at.__setitem__(i, time.perf_counter() - t0)
                )
                blocked.append(time.perf_counter() - start)
        if saver is not None:
            saver.close()
            total = [s.total_s for s in saver.history]
        else:
            future.result()
            total = [done_at[i] for i in range(saves)]
        results[kind] = {"blocked_s": blocked, "waited_s": waited, "total_s": total}
    dist.barrier()
    return results


def summarise_comparison(results: list[dict]) -> dict[str, dict[str, float]]:
    """Per saver, over ranks: first-call blocking, and the worst rank's mean of the
    later calls (a step waits for its slowest rank)."""
    summary = {}
    for kind in ("sync", "async", "dcp_async"):
        later = [sum(r[kind]["blocked_s"][1:]) / len(r[kind]["blocked_s"][1:]) for r in results]
        totals = [sum(r[kind]["total_s"][1:]) / len(r[kind]["total_s"][1:]) for r in results]
        summary[kind] = {
            "first_blocked_s": max(r[kind]["blocked_s"][0] for r in results),
            "blocked_s": max(later),
            "total_s": max(totals),
        }
    return summary
