"""Checkpoints that a crash cannot tear: the on-disk format, its commit point, and resuming.

Every checkpoint commits the way databases do::

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

Who writes them, and how long training waits for it, is :mod:`labkit.savers`.
:func:`capture_training_state` / :func:`restore_training_state` cover everything
a resumed run needs to continue bit-identically on the CPU: model, optimizer, the
Python / NumPy / torch (CPU and CUDA) random generators and the loader position.
"""

from __future__ import annotations

import json
import random
import shutil
import time
import warnings
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from labkit.atomic import atomic_file, fsync_dir, write_bytes_atomic

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


def check_save_args(step: int, state: Any) -> None:
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if not isinstance(state, dict):
        raise ValueError(f"state must be a dict, got {type(state).__name__}")
    check_loadable(state)


def check_keep(keep: int) -> None:
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
    check_keep(keep)
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
