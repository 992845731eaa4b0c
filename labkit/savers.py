"""Who writes a checkpoint, and how long training waits for it.

A synchronous save (:class:`SyncSaver`, the baseline) makes every training step
wait for serialisation, the disk and ``fsync``. The two-phase save
(:class:`AsyncSaver`) only waits for a copy of the state into host memory
(pinned on a GPU so the device-to-host copy is a fast DMA), then returns to
training while a background thread streams that copy to storage. At most one save
is in flight: the next save first waits for the previous write, which bounds the
extra host memory to one copy of the state (the cost the DCP recipe warns about).
Both commit through :func:`labkit.checkpoint.write_checkpoint`, so a crash during
either leaves the previous checkpoint in charge.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from labkit.atomic import remove_stale_temporaries
from labkit.checkpoint import (SaveStats, check_keep, check_save_args, list_checkpoints, prune, step_dir,
                               write_checkpoint)


class _SaverBase:
    def __init__(self, directory: str | Path, *, keep: int = 3):
        check_keep(keep)
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
        check_save_args(step, state)
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
        self._staged: dict | None = None

    @property
    def staging_bytes(self) -> int:
        """Host memory held for snapshots (the price of not blocking)."""
        return self._staging.bytes

    def save(self, step: int, state: dict) -> SaveStats:
        check_save_args(step, state)
        start = time.perf_counter()
        self.wait()
        staged = self._staged = self._staging.snapshot(state)
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

    def in_memory(self) -> dict | None:
        """The newest save's snapshot, still in host memory after its write: a restore cache.

        A trainer restarted in this process restores from it at memory speed instead
        of fetching the checkpoint from storage (Lab 7 measures the two). Valid until
        the next save reuses its buffers; None before the first save and after close.
        """
        return self._staged

    def close(self) -> None:
        """Commit the last save and release the staging memory."""
        try:
            self.wait()
        finally:
            self._staged = None
            self._staging.buffers.clear()

    def __enter__(self) -> "AsyncSaver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


SAVERS = {"sync": SyncSaver, "async": AsyncSaver}
