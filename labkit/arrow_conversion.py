"""Lab 1's conversion rungs: the slice as Parquet, turned into tensors row by row or by columns.

Mittal's root cause was not a read: it was the PyArrow-to-NumPy conversion a
Petastorm-style reader repeats every epoch. Many training sets are written by a
Spark job as Parquet: one row per sample, its decoded pixels in an array column,
its label beside it. A local copy of that file is a raw cache (no request leaves
the machine), and every epoch still pays for

* **read**: Parquet pages from the disk to Arrow columns (decompress, and unpack
  the array column's one level per value: about 0.7 ms per 226-px image here
  from the page cache, 0.7-1.5 ms from the disk in ten runs of Lab 1);
* **convert**: Arrow to the tensors the model takes. Row by row
  (:func:`rowwise`), each row becomes Python objects (``to_pylist``) and then a
  NumPy array, one Python int per pixel (3.5-3.6 ms an image in those runs, on a
  2-core box); by columns (:func:`columnar`) the pixel column's buffer is viewed
  as NumPy without a copy (0.002-0.003 ms);
* **resize** to the training resolution (per image in both: the rows differ in shape);
* **augment**: a random flip, per sample row by row, on the batch by columns.

The reader runs in the training process, as Petastorm's default reader does
(``make_reader(reader_pool_type='thread')``: threads whose Python conversion
takes turns on the interpreter lock), between steps: each batch's conversion is
time the accelerator waits, and :class:`ReaderLog` can split that wait by stage.
Overlapping it with the step would hide at most the step's compute, here about
2% of a row-wise batch's conversion.
Caching the *transformed* output (:class:`~labkit.loaders.TransformedCache`)
removes all four, which is why it, not a faster reader, is Mittal's fix.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import torch
from PIL import Image
from tqdm.auto import tqdm

from labkit.atomic import atomic_file
from labkit.loaders import Batch, BatchDigest, flip_batch, flip_decision, shuffled_order
from labkit.plots import PALETTE, figure

STAGES = ("read", "convert", "resize", "augment")


@dataclass
class ReaderLog:
    """What a reader did in one epoch: seconds in each of :data:`STAGES`, images, and a digest of each batch.

    The digests let two readers of one file be compared batch by batch, pixels and
    flips included, without keeping the batches.
    """

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    images: int = 0
    digests: list[BatchDigest] = field(default_factory=list)

    def delivered(self, batch: Batch) -> None:
        self.images += len(batch[1])
        self.digests.append(BatchDigest.of(batch))

    @contextmanager
    def timing(self, stage: str) -> Iterator[None]:
        if stage not in self.seconds:
            raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] += time.perf_counter() - start

    def ms_per_image(self) -> dict[str, float]:
        """Each stage's milliseconds per image delivered (0 for all before any image)."""
        return {stage: 1e3 * s / self.images if self.images else 0.0 for stage, s in self.seconds.items()}

    def describe(self) -> str:
        per = self.ms_per_image()
        return ", ".join(f"{stage} {ms:.3f}" for stage, ms in per.items()) + " ms per image"


def write_slice(paths: Sequence[str], labels: Sequence[int], target: str | Path, *, row_group_size: int) -> Path:
    """Decode each JPEG at its own resolution and write the slice as Parquet, once (atomically).

    One row per image: ``pixels`` (a list of uint8, height x width x 3),
    ``height``, ``width``, ``label`` and ``index`` (the image's place in the slice,
    which decides its flip). Rows are written in a seeded shuffled order, so each
    row group mixes the classes, as a shuffled Spark write would. An existing file
    with the same rows and row groups is reused.
    """
    if row_group_size < 1:
        raise ValueError(f"row_group_size must be >= 1, got {row_group_size}")
    if len(paths) != len(labels) or not paths:
        raise ValueError(f"paths and labels must be non-empty and of one length, got {len(paths)} and {len(labels)}")
    target = Path(target)
    if target.exists():
        meta = pq.ParquetFile(target).metadata
        if meta.num_rows == len(paths) and meta.row_group(0).num_rows == min(row_group_size, len(paths)):
            return target
    order = shuffled_order(len(paths), seed=1, epoch=0)
    images = [np.asarray(Image.open(paths[i]).convert("RGB"))
              for i in tqdm(order, desc="writing the slice as Parquet")]
    offsets = np.concatenate([[0], np.cumsum([image.size for image in images])]).astype(np.int64)
    pixels = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate([i.reshape(-1) for i in images])))
    table = pa.table({"pixels": pixels,
                      "height": pa.array([i.shape[0] for i in images], pa.int32()),
                      "width": pa.array([i.shape[1] for i in images], pa.int32()),
                      "label": pa.array(np.asarray(labels)[order], pa.int64()),
                      "index": pa.array(order, pa.int64())})
    with atomic_file(target) as tmp:
        pq.write_table(table, tmp, row_group_size=row_group_size)
    return target


def _resize(image: np.ndarray, image_px: int) -> np.ndarray:
    """height x width x 3 -> 3 x image_px x image_px, as the file loader resizes (PIL, bilinear)."""
    resized = Image.fromarray(image).resize((image_px, image_px), Image.BILINEAR)
    return np.ascontiguousarray(np.asarray(resized).transpose(2, 0, 1))


def rowwise(table: pa.Table, log: ReaderLog, *, image_px: int, seed: int, epoch: int) -> Batch:
    """A Petastorm-style row-wise conversion: Arrow -> Python objects -> NumPy, one row at a time."""
    with log.timing("convert"):
        rows = table.to_pylist()
        arrays = [np.array(row["pixels"], dtype=np.uint8).reshape(row["height"], row["width"], 3) for row in rows]
    with log.timing("resize"):
        samples = [torch.from_numpy(_resize(array, image_px)) for array in arrays]
    with log.timing("augment"):
        samples = [s.flip(-1) if flip_decision(seed, epoch, row["index"]) else s for s, row in zip(samples, rows)]
        images = torch.stack(samples)
        labels = torch.tensor([row["label"] for row in rows])
    return images, labels


def columnar(table: pa.Table, log: ReaderLog, *, image_px: int, seed: int, epoch: int) -> Batch:
    """A columnar conversion: the pixel column's Arrow buffer viewed as NumPy, no per-row Python objects."""
    with log.timing("convert"):
        pixels = table.column("pixels")   # a row group reads as one chunk: viewed, not copied
        column = pixels.chunk(0) if pixels.num_chunks == 1 else pixels.combine_chunks(memory_pool=read_pool())
        values = column.values.to_numpy(zero_copy_only=True)
        offsets = column.offsets.to_numpy()
        heights, widths = table.column("height").to_numpy(), table.column("width").to_numpy()
        labels = torch.tensor(table.column("label").to_numpy())
        index = torch.tensor(table.column("index").to_numpy())
    with log.timing("resize"):
        images = torch.empty((len(heights), 3, image_px, image_px), dtype=torch.uint8)
        for k in range(len(heights)):
            images[k] = torch.from_numpy(_resize(values[offsets[k]:offsets[k + 1]].reshape(heights[k], widths[k], 3),
                                                 image_px))
    with log.timing("augment"):
        images = flip_batch(images, seed, epoch, index)
    return images, labels


CONVERSIONS = {"row-wise": rowwise, "columnar": columnar}


def read_pool() -> pa.MemoryPool:
    """The Arrow memory pool the readers read through: jemalloc where this pyarrow has it, else the system's malloc.

    Not Arrow's default, mimalloc, on purpose: it backs its arenas with transparent
    huge pages, and on the 2-core VM this course is tested on, fresh memory is slow
    to touch now and then (128 MB took 17-20 ms in four tries of six, 340-540 ms in
    two). Read through mimalloc, the first two row groups a process read took
    1.3-1.5 s and 0.6-0.8 s instead of about 0.1 s (1340-1410 huge-page faults over
    six epochs, against 14 through jemalloc), so whichever reader ran first was
    charged that as its read: 5.7 ms an image row-wise against 0.8 columnar in one
    run of Lab 1, where both read the same file. Through jemalloc every row group
    took 0.08-0.32 s, whichever reader ran first; through the system's malloc
    0.21-0.32 s, a fresh mapping for each row group.
    """
    try:
        return pa.jemalloc_memory_pool()
    except NotImplementedError:   # a pyarrow built without jemalloc (macOS wheels)
        return pa.system_memory_pool()


class ParquetBatches:
    """One epoch of the Parquet slice, a row group per batch, the row groups in a seeded shuffled order."""

    def __init__(self, path: str | Path, *, conversion: str, image_px: int, log: ReaderLog,
                 seed: int = 0, epoch: int = 0):
        if conversion not in CONVERSIONS:
            raise ValueError(f"conversion must be one of {sorted(CONVERSIONS)}, got {conversion!r}")
        if image_px < 1:
            raise ValueError(f"image_px must be >= 1, got {image_px}")
        self.path, self.convert = Path(path), CONVERSIONS[conversion]
        self.image_px, self.log, self.seed, self.epoch = image_px, log, seed, epoch

    def __iter__(self) -> Iterator[Batch]:
        (fragment,) = ds.dataset(self.path, format="parquet").get_fragments()
        groups, pool = fragment.split_by_row_group(), read_pool()
        for group in shuffled_order(len(groups), self.seed, self.epoch):
            with self.log.timing("read"):
                table = groups[int(group)].to_table(memory_pool=pool)
            batch = self.convert(table, self.log, image_px=self.image_px, seed=self.seed, epoch=self.epoch)
            self.log.delivered(batch)
            yield batch


def plot_stages(logs: dict[str, ReaderLog], compute_ms_per_image: float):
    """One stacked bar per reader: its milliseconds per image in each stage, beside the accelerator's compute."""
    fig, (ax,) = figure(1, width=9, height=2.8)
    names = list(logs)
    left = [0.0] * len(names)
    for stage, colour in zip(STAGES, PALETTE):
        widths = [logs[name].ms_per_image()[stage] for name in names]
        ax.barh(names, widths, left=left, color=colour, label=stage)
        left = [a + b for a, b in zip(left, widths)]
    ax.axvline(compute_ms_per_image, color="black", linestyle="--",
               label=f"accelerator compute ({compute_ms_per_image:.2f} ms)")
    ax.set_xlabel("loader time per image (ms), measured")
    ax.set_title("where the Parquet reader's time went")
    ax.invert_yaxis()
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig
