"""Lab 1's input pipelines, from the slow path to the fix, side by side.

Every loader yields the same batches -- ``(uint8 images [B, 3, px, px], int64
labels [B])`` -- so the training loop, and the step meter around it, never
change; only where the pixels come from does:

* :class:`InRamBatches` -- a training slice already decoded in RAM: the ceiling.
* :func:`file_loader` -- the normal path: read a JPEG, decode, resize, flip.
* :func:`fetched_loader` -- every object fetched from an object store: a real
  HTTP server process (:mod:`labkit.objectstore`) whose first-byte latency is an
  emulated condition, since this box has no remote storage.
* :class:`RawCache` -- remote bytes cached in RAM: removes the latency, keeps the
  conversion cost.
* :class:`TransformedCache` -- decoded, resized pixels cached on local disk: the
  fix Mittal describes (cache the *converted* tensors, not the raw reads).

The loaders are deterministic: the order comes from a seeded sampler, each
DataLoader worker is handed its batches up front and the batches come back in
order, and the random flip of a sample depends only on (seed, epoch, index).
:func:`naive_parallel_batches` keeps the pitfall for comparison.
"""

from __future__ import annotations

import functools
import hashlib
import io
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset as TorchDataset
from tqdm.auto import tqdm

from labkit.atomic import atomic_file
from labkit.devices import cpu_ms_per_item

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class BatchDigest:
    """What a training step receives, in brief: the labels and a hash of the pixels (flips included)."""

    labels: tuple[int, ...]
    pixels_sha1: str

    @classmethod
    def of(cls, batch: Batch) -> "BatchDigest":
        images, labels = batch
        return cls(tuple(labels.tolist()), hashlib.sha1(images.contiguous().numpy().tobytes()).hexdigest())


def decode(data: bytes, image_px: int, *, draft: bool = False) -> np.ndarray:
    """JPEG bytes -> uint8 (image_px, image_px, 3).

    ``draft`` lets libjpeg decode at a reduced scale (1/2, 1/4, 1/8) straight
    from the DCT coefficients, so most pixels are never produced: the decode-side
    fix for training at a resolution far below the stored one.
    """
    image = _open_rgb(data, image_px, draft=draft)
    return np.asarray(image.resize((image_px, image_px), Image.BILINEAR))


def _open_rgb(data: bytes, image_px: int, *, draft: bool) -> Image.Image:
    if image_px < 1:
        raise ValueError(f"image_px must be >= 1, got {image_px}")
    image = Image.open(io.BytesIO(data))
    if draft:
        image.draft("RGB", (image_px, image_px))
    return image.convert("RGB")


PIL_CUTS = ("read", "decode", "resize")


def _cut_after(stage: str, path: str, image_px: int) -> None:
    data = Path(path).read_bytes()
    if stage == "decode":
        _open_rgb(data, image_px, draft=False)
    elif stage == "resize":
        decode(data, image_px)


def stage_costs(paths: Sequence[str], image_px: int, *, repeats: int = 2) -> dict[str, float]:
    """CPU milliseconds per image of a DataLoader worker's path cut after each stage (best of ``repeats``).

    The same cuts as the data engine's (``dataengine.stage_costs``), so the two paths
    can be compared stage by stage: a faster engine shortens only the stages it
    changes. One thread, as each worker runs it.
    """
    if not paths:
        raise ValueError("paths must name at least one image, got none")
    if image_px < 1:
        raise ValueError(f"image_px must be >= 1, got {image_px}")
    runs = {stage: functools.partial(_cut_all_after, stage, paths, image_px) for stage in PIL_CUTS}
    return cpu_ms_per_item(runs, len(paths), repeats=repeats)


def _cut_all_after(stage: str, paths: Sequence[str], image_px: int) -> None:
    for path in paths:
        _cut_after(stage, path, image_px)


def flip_decisions(seed: int, epoch: int, indices: np.ndarray) -> np.ndarray:
    """Per-sample augmentation that depends on what the sample is, not which worker ran it.

    A splitmix64 hash of (seed, epoch, index): the same answer in any worker, in
    any order, vectorised so a whole batch costs one call.
    """
    with np.errstate(over="ignore"):
        x = (np.asarray(indices, dtype=np.uint64) + np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15)
             + np.uint64(epoch) * np.uint64(0xBF58476D1CE4E5B9))
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(63)).astype(bool)


def flip_decision(seed: int, epoch: int, index: int) -> bool:
    return bool(flip_decisions(seed, epoch, np.array([index]))[0])


def shuffled_order(num_items: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_items)


class _DecodedImages(TorchDataset):
    """Fetch bytes with ``fetch(i)``, decode, resize, flip: the conversion on every step.

    With ``get_threads`` > 1 a worker fetches a batch's objects from that many
    threads and decodes each as it arrives, so it keeps ``get_threads`` requests in
    flight instead of one: against a store's first-byte latency, the number that
    bounds its rate (Little's law).
    """

    def __init__(self, fetch: Callable[[int], bytes], labels: Sequence[int], image_px: int,
                 *, draft: bool, augment: bool, seed: int, epoch: int = 0, get_threads: int = 1):
        if get_threads < 1:
            raise ValueError(f"get_threads must be >= 1, got {get_threads}")
        self.fetch, self.labels, self.image_px = fetch, list(labels), image_px
        self.draft, self.augment, self.seed, self.epoch = draft, augment, seed, epoch
        self.get_threads = get_threads
        self._pool: ThreadPoolExecutor | None = None   # made in the process that uses it, never pickled

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self._sample(index, self.fetch(index))

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, int]]:
        """A batch (the DataLoader asks for it whole): its GETs from ``get_threads`` threads."""
        if self.get_threads == 1:
            return [self[index] for index in indices]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.get_threads, thread_name_prefix="labkit-get")
        return [self._sample(index, blob) for index, blob in zip(indices, self._pool.map(self.fetch, indices))]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_pool": None}

    def _sample(self, index: int, blob: bytes) -> tuple[torch.Tensor, int]:
        pixels = decode(blob, self.image_px, draft=self.draft)
        if self.augment and flip_decision(self.seed, self.epoch, index):
            pixels = pixels[:, ::-1]
        return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1))), self.labels[index]


class _ReadFile:
    """Picklable ``fetch`` for DataLoader workers."""

    def __init__(self, paths: Sequence[str]):
        self.paths = list(paths)

    def __call__(self, index: int) -> bytes:
        return Path(self.paths[index]).read_bytes()


def _check_sizes(batch_size: int, num_workers: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")


def _decoded_loader(fetch: Callable[[int], bytes], labels: Sequence[int], *, batch_size: int, image_px: int,
                    num_workers: int, seed: int, epoch: int, augment: bool, draft: bool,
                    prefetch_factor: int, get_threads: int = 1) -> DataLoader:
    _check_sizes(batch_size, num_workers)
    images = _DecodedImages(fetch, labels, image_px, draft=draft, augment=augment, seed=seed, epoch=epoch,
                            get_threads=get_threads)
    return DataLoader(
        images,
        batch_size=batch_size,
        sampler=shuffled_order(len(images), seed, epoch).tolist(),
        num_workers=num_workers,
        prefetch_factor=prefetch_factor if num_workers else None,
        persistent_workers=False,
    )


def file_loader(paths: Sequence[str], labels: Sequence[int], *, batch_size: int, image_px: int = 32,
                num_workers: int = 2, seed: int = 0, epoch: int = 0, augment: bool = True,
                draft: bool = False, prefetch_factor: int = 2) -> DataLoader:
    """The normal path: a PyTorch DataLoader whose workers read, decode, resize and flip."""
    if len(paths) != len(labels):
        raise ValueError(f"paths and labels must have the same length, got {len(paths)} and {len(labels)}")
    return _decoded_loader(_ReadFile(paths), labels, batch_size=batch_size, image_px=image_px,
                           num_workers=num_workers, seed=seed, epoch=epoch, augment=augment,
                           draft=draft, prefetch_factor=prefetch_factor)


def fetched_loader(fetch: Callable[[int], bytes], labels: Sequence[int], **kwargs) -> DataLoader:
    """The remote path: workers fetch each object with ``fetch`` (a GET to :mod:`labkit.objectstore`'s
    server, through :class:`labkit.objectstore.HttpFetch`), then decode it. Every epoch fetches every
    object again: the store's latency is on the critical path."""
    return _decoded_loader(fetch, labels, **_loader_defaults(kwargs))


class RawCache:
    """Raw bytes kept in RAM after one fetch: the latency is gone, the conversion is not."""

    def __init__(self, blobs: list[bytes]):
        self.blobs = blobs

    @classmethod
    def fill(cls, fetch: Callable[[int], bytes], count: int, *, threads: int = 32) -> "RawCache":
        """Fetch every object once, many at a time (a GET is I/O-bound, so threads help)."""
        with ThreadPoolExecutor(threads) as pool:
            blobs = list(tqdm(pool.map(fetch, range(count)), total=count, desc="filling raw cache"))
        return cls(blobs)

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.blobs)

    def __call__(self, index: int) -> bytes:
        return self.blobs[index]

    def loader(self, labels: Sequence[int], **kwargs) -> DataLoader:
        return _decoded_loader(self, labels, **_loader_defaults(kwargs))


def _loader_defaults(kwargs: dict) -> dict:
    defaults = dict(batch_size=64, image_px=32, num_workers=2, seed=0, epoch=0, augment=True,
                    draft=False, prefetch_factor=2, get_threads=1)
    unknown = set(kwargs) - set(defaults)
    if unknown:
        raise TypeError(f"unknown loader arguments {sorted(unknown)}; valid: {sorted(defaults)}")
    return {**defaults, **kwargs}


class InRamBatches:
    """Decoded, resized pixels held in RAM; flips applied to the whole batch.

    Random augmentation moves from the sample (in a worker) to the batch (on the
    accelerator, where there is one): one flip mask per batch costs almost nothing.
    """

    def __init__(self, pixels: torch.Tensor, labels: torch.Tensor, *, batch_size: int, seed: int = 0,
                 epoch: int = 0, augment: bool = True, device: torch.device | str = "cpu"):
        _check_sizes(batch_size, 0)
        if pixels.ndim != 4 or pixels.shape[1] != 3 or pixels.dtype != torch.uint8:
            raise ValueError(f"pixels must be uint8 [N, 3, H, W], got {pixels.dtype} {tuple(pixels.shape)}")
        self.pixels, self.labels = pixels, labels
        self.batch_size, self.seed, self.epoch, self.augment = batch_size, seed, epoch, augment
        self.device = torch.device(device)

    def __len__(self) -> int:
        return (len(self.labels) + self.batch_size - 1) // self.batch_size

    def __iter__(self) -> Iterator[Batch]:
        order = torch.from_numpy(shuffled_order(len(self.labels), self.seed, self.epoch))
        for start in range(0, len(order), self.batch_size):
            index = order[start:start + self.batch_size]
            images = to_device(self._rows(index), self.device)
            if self.augment:
                images = flip_batch(images, self.seed, self.epoch, index)
            yield images, self.labels.index_select(0, index)

    def _rows(self, index: torch.Tensor) -> torch.Tensor:
        if isinstance(self.pixels, torch.Tensor):
            return self.pixels.index_select(0, index)
        return self.pixels[index.numpy()]


def to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host batch to ``device``; to a GPU, through pinned (page-locked) memory.

    A CUDA copy can overlap with compute only from pinned memory: the GPU's copy
    engine reads it by DMA while the kernels of the previous step still run. From
    ordinary (pageable) memory the driver first copies into a pinned buffer of its
    own and the host waits for it, so ``non_blocking=True`` there silently blocks.
    Pinning the gathered batch costs one host copy of it (about 0.8 MB at 256 x 3 x
    32 x 32), which buys a copy that really runs in the background.
    """
    if device.type != "cuda":
        return batch.to(device)
    return batch.pin_memory().to(device, non_blocking=True)


def flip_batch(images: torch.Tensor, seed: int, epoch: int, index: torch.Tensor) -> torch.Tensor:
    """Flip, in place, the samples whose per-sample decision says so: one pass over the batch."""
    chosen = torch.from_numpy(np.flatnonzero(flip_decisions(seed, epoch, index.numpy()))).to(images.device)
    images[chosen] = images.index_select(0, chosen).flip(-1)
    return images


def decode_all(fetch: Callable[[int], bytes], count: int, image_px: int, *, draft: bool = True,
               desc: str = "decoding") -> np.ndarray:
    """Decode every image once: uint8 [N, 3, px, px]."""
    pixels = np.empty((count, 3, image_px, image_px), dtype=np.uint8)
    for i in tqdm(range(count), desc=desc):
        pixels[i] = decode(fetch(i), image_px, draft=draft).transpose(2, 0, 1)
    return pixels


def decode_files(paths: Sequence[str], image_px: int, *, desc: str = "decoding") -> np.ndarray:
    """Decode every file once: uint8 [N, 3, px, px]."""
    return decode_all(_ReadFile(paths), len(paths), image_px, desc=desc)


@dataclass(frozen=True)
class TransformedCache:
    """Converted pixels on local disk (a NumPy memory map), built once, read every epoch.

    It costs disk (3 * px * px bytes an image, uncompressed), and it freezes any
    augmentation applied before it -- so only the deterministic part (decode,
    resize) is cached and random flips move to the batch.
    """

    path: Path
    labels: np.ndarray

    @classmethod
    def build(cls, paths: Sequence[str], labels: Sequence[int], path: str | Path, *, image_px: int) -> "TransformedCache":
        path = Path(path)
        labels_array = np.asarray(labels, dtype=np.int64)
        if path.exists():
            cached = np.load(path, mmap_mode="r")
            if cached.shape == (len(paths), 3, image_px, image_px):
                return cls(path, labels_array)
        pixels = decode_files(paths, image_px, desc="building transformed cache")
        with atomic_file(path) as tmp:
            with open(tmp, "wb") as handle:
                np.save(handle, pixels)
        return cls(path, labels_array)

    @property
    def nbytes(self) -> int:
        return self.path.stat().st_size

    def loader(self, *, batch_size: int, seed: int = 0, epoch: int = 0, augment: bool = True,
               device: torch.device | str = "cpu") -> InRamBatches:
        pixels = np.load(self.path, mmap_mode="r")
        return InRamBatches(_MemmapPixels(pixels), torch.from_numpy(self.labels), batch_size=batch_size,
                            seed=seed, epoch=epoch, augment=augment, device=device)


class _MemmapPixels:
    """Quacks like the uint8 tensor InRamBatches indexes, reading rows from the memory map."""

    def __init__(self, array: np.ndarray):
        self.array = array
        self.ndim, self.shape, self.dtype = 4, (array.shape[0], *array.shape[1:]), torch.uint8

    def __getitem__(self, index: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(self.array[np.sort(index)][np.argsort(np.argsort(index))])


def naive_parallel_batches(paths: Sequence[str], labels: Sequence[int], *, batch_size: int,
                           workers: int = 2, image_px: int = 32) -> list[list[int]]:
    """THE PITFALL: each worker takes a contiguous shard of the file listing and all of
    them push into one shared queue; batches are cut in arrival order.

    File listings are usually sorted (here, by class folder), so each worker
    serves a few classes at a time and batches are skewed; the interleaving of
    workers depends on timing, so the order changes from run to run. Returns the
    labels of each batch.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    order = sorted(range(len(paths)), key=lambda i: paths[i])
    shards = np.array_split(np.array(order), workers)
    arrivals: queue.Queue[int] = queue.Queue()

    def work(shard: np.ndarray) -> None:
        for index in shard:
            decode(Path(paths[index]).read_bytes(), image_px)
            arrivals.put(labels[index])

    threads = [threading.Thread(target=work, args=(shard,)) for shard in shards]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    arrived = [arrivals.get() for _ in range(len(paths))]
    return [arrived[i:i + batch_size] for i in range(0, len(arrived), batch_size)]


def batch_label_skew(batches: Sequence[Sequence[int]], num_classes: int) -> float:
    """Mean share of the most common class in a batch (1/num_classes is perfectly mixed)."""
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    shares = [np.bincount(b, minlength=num_classes).max() / len(b) for b in batches if len(b)]
    return float(np.mean(shares))
