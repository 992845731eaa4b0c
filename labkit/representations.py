"""Three ways to store the same selected images, and what each costs to write, fetch and read.

* **files** -- the catalog's paths; every image is one object to fetch, then decoded
  and resized at every step (decode-per-step);
* **packed** -- the JPEG bytes inside a Parquet file, grouped in row groups: the same
  bytes, but one request fetches a whole row group, so remote storage pays its
  per-object latency N / rows-per-group times instead of N;
* **tensor cache** -- decoded, resized uint8 tensors in Parquet, written by the engine:
  Lab 1's transformed cache, paid for once instead of every epoch.

Fetch costs come from the object store's own log (:mod:`labkit.objectstore`), and
so does pushdown: a column or row group Daft did not need is a request the server
never saw. The pipeline that decodes them is :mod:`labkit.dataengine`.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import daft
import pyarrow.parquet as pq
import torch
from daft import col

from labkit.atomic import atomic_file
from labkit.dataengine import check_positive, decode_pipeline, torch_batches
from labkit.objectstore import HttpFetch, ObjectStore, open_ranged


@dataclass(frozen=True)
class Representation:
    """One way of storing the selected images, and what it costs on disk."""

    name: str
    objects: int
    disk_bytes: int
    rows: int
    row_groups: int
    write_s: float
    path: Path | None = None

    @property
    def bytes_per_image(self) -> float:
        return self.disk_bytes / self.rows if self.rows else 0.0

    def as_row(self) -> dict[str, object]:
        return {
            "representation": self.name,
            "objects": self.objects,
            "row_groups": self.row_groups,
            "disk_MB": round(self.disk_bytes / 1e6, 2),
            "bytes_per_image": round(self.bytes_per_image),
            "write_s": round(self.write_s, 2),
        }


def files_representation(frame: daft.DataFrame) -> Representation:
    """The catalog's own representation: one object per image, sizes from the ``bytes`` column."""
    table = frame.select("bytes").to_pydict()["bytes"]
    return Representation(
        name="files", objects=len(table), disk_bytes=int(sum(table)), rows=len(table),
        row_groups=0, write_s=0.0,
    )


def _representation(name: str, target: Path, write_s: float) -> Representation:
    metadata = pq.ParquetFile(target).metadata
    return Representation(
        name=name, objects=1, disk_bytes=target.stat().st_size, rows=metadata.num_rows,
        row_groups=metadata.num_row_groups, write_s=write_s, path=target,
    )


def write_packed(
    frame: daft.DataFrame, target: str | Path, *, rows_per_group: int = 128
) -> Representation:
    """Pack the selected images' JPEG bytes into one Parquet file (the remote-storage format).

    Daft downloads the bytes and cuts exact batches of ``rows_per_group``; pyarrow's
    writer makes each batch one row group, the unit a reader fetches in one request.
    """
    check_positive(rows_per_group=rows_per_group)
    target = Path(target)
    packed = frame.select(col("image_id"), col("label"), col("path").download().alias("jpeg"))
    start = time.perf_counter()
    batches = packed.into_batches(rows_per_group).to_arrow_iter()
    first = next(batches, None)
    if first is None:
        raise ValueError("frame must select at least one image, got an empty selection")
    with atomic_file(target) as tmp:
        with pq.ParquetWriter(tmp, first.schema) as writer:
            for batch in itertools.chain([first], batches):
                writer.write_batch(batch, row_group_size=rows_per_group)
    return _representation("packed", target, time.perf_counter() - start)


def write_tensor_cache(frame: daft.DataFrame, target: str | Path, image_px: int) -> Representation:
    """Decode and resize once; Daft writes the uint8 tensors to Parquet (the training cache)."""
    target = Path(target)
    start = time.perf_counter()
    with atomic_file(target) as tmp:
        decode_pipeline(frame, image_px).write_parquet(str(tmp), write_mode="overwrite", single_file=True)
    return _representation("tensor cache", target, time.perf_counter() - start)


def file_batches(
    frame: daft.DataFrame, image_px: int, batch_size: int, *, resizer: str = "torch"
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Decode-per-step from the files the catalog points at."""
    return torch_batches(decode_pipeline(frame, image_px, resizer=resizer), batch_size)


def packed_batches(
    path: str | Path, image_px: int, batch_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Decode-per-step from JPEG bytes packed in Parquet."""
    frame = daft.read_parquet(str(path))
    return torch_batches(decode_pipeline(frame, image_px, bytes_column="jpeg"), batch_size)


def cache_batches(path: str | Path, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Ready tensors from the cache: no decode, no resize."""
    return torch_batches(daft.read_parquet(str(path)).select("image", "label"), batch_size)


@dataclass(frozen=True)
class FetchResult:
    """What fetching a representation's bytes cost from the object store, as its server logged it."""

    name: str
    images: int
    data_requests: int
    metadata_requests: int
    bytes_read: int
    fetch_s: float

    def as_row(self) -> dict[str, object]:
        return {
            "representation": self.name,
            "images": self.images,
            "data_requests": self.data_requests,
            "metadata_requests": self.metadata_requests,
            "MB_read": round(self.bytes_read / 1e6, 2),
            "fetch_s": round(self.fetch_s, 3),
        }


def fetch_files(store: ObjectStore, paths: Sequence[str]) -> FetchResult:
    """GET every image file from ``store``, one after another: one request per object."""
    fetch = HttpFetch([store.url(path) for path in paths])
    before = len(store.log())
    start = time.perf_counter()
    for index in range(len(paths)):
        fetch(index)
    fetch_s = time.perf_counter() - start
    served = store.log()[before:]
    return FetchResult(name="files", images=len(paths), data_requests=len(served), metadata_requests=0,
                       bytes_read=sum(record["bytes"] for record in served), fetch_s=fetch_s)


def fetch_parquet(
    store: ObjectStore, path: str | Path, *, name: str, max_images: int | None = None,
) -> FetchResult:
    """Read a Parquet file from ``store`` row group by row group, as a reader on object storage does.

    pyarrow's ``pre_buffer`` coalesces one row group's column chunks into one ranged
    request; finding the footer (a HEAD for the size, then the footer itself) costs
    requests of its own. With ``max_images`` it stops after the row group that
    reaches that many images. Requests and bytes come from the server's log.
    """
    before = len(store.log())
    start = time.perf_counter()
    with open_ranged(store.url(path)) as handle:
        parquet = pq.ParquetFile(handle, pre_buffer=True)
        metadata_requests = len(store.log()) - before
        images = 0
        for index in range(parquet.num_row_groups):
            if max_images is not None and images >= max_images:
                break
            images += parquet.read_row_group(index).num_rows
    fetch_s = time.perf_counter() - start
    served = store.log()[before:]
    return FetchResult(name=name, images=images, data_requests=len(served) - metadata_requests,
                       metadata_requests=metadata_requests, bytes_read=sum(record["bytes"] for record in served),
                       fetch_s=fetch_s)


@dataclass(frozen=True)
class PushdownReads:
    """Bytes the object store served for three Daft reads of one packed Parquet file."""

    whole_bytes: int
    """Every column of every row."""
    projected_bytes: int
    """``select("label")``: projection pushdown fetches that column's chunks only."""
    filtered_bytes: int
    """``where(image_id <= the first row group's max)``: filter pushdown skips row groups by their statistics."""
    row_groups: int

    def as_row(self) -> dict[str, object]:
        return {"whole_MB": round(self.whole_bytes / 1e6, 3), "label_column_MB": round(self.projected_bytes / 1e6, 3),
                "first_row_group_MB": round(self.filtered_bytes / 1e6, 3), "row_groups": self.row_groups}


def read_parquet_url(url: str) -> daft.DataFrame:
    """Daft's lazy Parquet scan of ``url``: what it later reads depends on the plan pushed into it."""
    return daft.read_parquet(url)


def pushdown_reads(store: ObjectStore, path: str | Path) -> PushdownReads:
    """Read a packed file from ``store`` whole, one column, and one row group's rows; bytes from the server's log.

    Daft pushes a ``select`` and a ``where`` into its Parquet scan: a column that is
    not asked for is not fetched, and a row group whose min/max statistics exclude
    the filter is skipped. The server's log shows whether that happened.
    """
    metadata = pq.ParquetFile(path).metadata
    image_id = metadata.schema.names.index("image_id")
    first_max = metadata.row_group(0).column(image_id).statistics.max
    url = store.url(path)

    def served(query: Callable[[daft.DataFrame], daft.DataFrame]) -> int:
        """Bytes served from planning the scan (Daft reads the footer then) to the last row."""
        before = len(store.log())
        query(read_parquet_url(url)).collect()
        return sum(record["bytes"] for record in store.log()[before:])

    return PushdownReads(
        whole_bytes=served(lambda frame: frame),
        projected_bytes=served(lambda frame: frame.select("label")),
        filtered_bytes=served(lambda frame: frame.where(col("image_id") <= first_max)),
        row_groups=metadata.num_row_groups,
    )


def expected_requests(num_images: int, rows_per_group: int) -> int:
    """Data requests for ``num_images`` packed ``rows_per_group`` to a row group (vs N for files)."""
    if num_images < 0 or rows_per_group < 1:
        raise ValueError(
            f"num_images must be >= 0 and rows_per_group >= 1, got {num_images}, {rows_per_group}"
        )
    return math.ceil(num_images / rows_per_group)


def rows_per_group(path: str | Path) -> int:
    """The largest row group of a Parquet file (for :func:`write_packed`, all but the last)."""
    metadata = pq.ParquetFile(path).metadata
    return max(metadata.row_group(index).num_rows for index in range(metadata.num_row_groups))
