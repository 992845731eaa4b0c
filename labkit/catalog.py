"""The metadata catalog: one compact Parquet table describing every image.

The images stay where they are (files, or objects in a bucket); the catalog keeps a
few bytes per image -- path, label, split, size, quality -- so that inspecting and
filtering a dataset reads kilobytes, not gigabytes. Daft reads the catalog lazily:
``where`` and ``groupby`` are planned and pushed into the Parquet scan, and only
the rows a training job selects ever lead to an image being fetched.

:class:`Selection` holds the filter in two forms on purpose: a Daft expression
(what the engine runs) and a plain-Python predicate (what a test uses to recount
the rows without any dataframe or Arrow compute), so the engine is checked by
something that shares none of its code.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Literal, Mapping

import daft
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from daft import col
from PIL import Image

from labkit import fresh_process

CATALOG_SCHEMA: dict[str, pa.DataType] = {
    "image_id": pa.int64(),
    "path": pa.string(),
    "label": pa.int64(),
    "label_name": pa.string(),
    "split": pa.string(),
    "width": pa.int32(),
    "height": pa.int32(),
    "bytes": pa.int64(),
    "quality": pa.float32(),
    "degraded": pa.bool_(),
    "degradation": pa.string(),
}
SPLITS = ("train", "val", "test")
DEGRADATIONS = ("none", "blur", "noise", "lowres", "overexposed")


class CatalogError(ValueError):
    """A catalog that cannot be used as it is; the message names the column or file and the fix."""


def catalog_path(source: str | Path | object) -> Path:
    """The Parquet file behind ``source``: a path, or a ``labkit.dataset.Dataset``."""
    path = Path(getattr(source, "catalog_path", source))
    if not path.exists():
        raise CatalogError(
            f"catalog file {path} does not exist; create it with "
            f"labkit.dataset.generate(num_images=...) or pass an existing catalog.parquet"
        )
    return path


def missing_columns(column_names: Iterable[str]) -> list[str]:
    """Catalog columns absent from ``column_names``, in schema order."""
    present = set(column_names)
    return [name for name in CATALOG_SCHEMA if name not in present]


def require_columns(column_names: Iterable[str], *, source: str | Path) -> None:
    missing = missing_columns(column_names)
    if missing:
        raise CatalogError(
            f"catalog {source} is missing column(s) {', '.join(repr(m) for m in missing)}; "
            f"a catalog needs {list(CATALOG_SCHEMA)} (regenerate it with "
            f"labkit.dataset.generate(..., overwrite=True))"
        )


def read_catalog(source: str | Path | object) -> daft.DataFrame:
    """A lazy Daft DataFrame over the catalog, after checking it has every column."""
    path = catalog_path(source)
    frame = daft.read_parquet(str(path))
    require_columns(frame.column_names, source=path)
    return frame


def schema_rows(frame: daft.DataFrame) -> list[tuple[str, str]]:
    """(column, Daft type) pairs: what the catalog promises before anything is read."""
    return [(field.name, str(field.dtype)) for field in frame.schema()]


def counts_by(frame: daft.DataFrame, column: str) -> dict[str, int]:
    """Rows per distinct value of ``column``, computed by Daft's group-by."""
    if column not in frame.column_names:
        raise CatalogError(f"column must be one of {frame.column_names}, got {column!r}")
    table = frame.groupby(column).agg(col(column).count().alias("rows")).sort(column).to_pydict()
    return {str(key): int(rows) for key, rows in zip(table[column], table["rows"])}


def quality_histogram(frame: daft.DataFrame, bins: int = 10) -> list[int]:
    """Rows per quality bin over [0, 1]: degraded images pile up at the low end."""
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    binned = frame.select(
        (col("quality") * bins).floor().cast(daft.DataType.int64()).clip(0, bins - 1).alias("bin")
    )
    table = binned.groupby("bin").agg(col("bin").count().alias("rows")).to_pydict()
    counts = [0] * bins
    for index, rows in zip(table["bin"], table["rows"]):
        counts[int(index)] = int(rows)
    return counts


@dataclass(frozen=True)
class Selection:
    """Which catalog rows a training job uses.

    ``split=None`` keeps every split; ``max_side_px=None`` sets no upper bound. A
    side is the smaller of width and height, the one a square crop is limited by.
    """

    split: str | None = "train"
    drop_degraded: bool = True
    min_quality: float = 0.0
    min_side_px: int = 0
    max_side_px: int | None = None

    def __post_init__(self) -> None:
        if self.split is not None and self.split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS} or None, got {self.split!r}")
        if not 0.0 <= self.min_quality <= 1.0:
            raise ValueError(f"min_quality must be in [0, 1], got {self.min_quality}")
        if self.min_side_px < 0:
            raise ValueError(f"min_side_px must be >= 0, got {self.min_side_px}")
        if self.max_side_px is not None and self.max_side_px < self.min_side_px:
            raise ValueError(
                f"max_side_px must be >= min_side_px ({self.min_side_px}), got {self.max_side_px}"
            )

    def expression(self) -> daft.Expression:
        """The filter as a Daft expression (pushed down into the Parquet scan)."""
        side = daft.functions.columns_min(col("width"), col("height"))
        keep = (col("quality") >= self.min_quality) & (side >= self.min_side_px)
        if self.split is not None:
            keep = keep & (col("split") == self.split)
        if self.drop_degraded:
            keep = keep & ~col("degraded")
        if self.max_side_px is not None:
            keep = keep & (side <= self.max_side_px)
        return keep

    def matches(self, row: Mapping[str, object]) -> bool:
        """The same filter in plain Python, for recounting without the engine."""
        side = min(int(row["width"]), int(row["height"]))
        return (
            (self.split is None or row["split"] == self.split)
            and not (self.drop_degraded and bool(row["degraded"]))
            and float(row["quality"]) >= self.min_quality
            and side >= self.min_side_px
            and (self.max_side_px is None or side <= self.max_side_px)
        )


def select(frame: daft.DataFrame, selection: Selection) -> daft.DataFrame:
    """The rows ``selection`` keeps (lazy: nothing is read until a result is asked for)."""
    return frame.where(selection.expression())


def catalog_rows(source: str | Path | object) -> list[dict[str, object]]:
    """Every catalog row as a Python dict: input for an engine-free recount."""
    return pq.read_table(catalog_path(source)).to_pylist()


def recount(rows: Iterable[Mapping[str, object]], selection: Selection) -> int:
    """How many rows ``selection`` keeps, counted one Python row at a time."""
    return sum(1 for row in rows if selection.matches(row))


@dataclass(frozen=True)
class PathCheck:
    frame: daft.DataFrame
    checked: int
    missing: tuple[str, ...]


def check_paths(
    frame: daft.DataFrame, *, on_missing: Literal["raise", "drop"] = "raise"
) -> PathCheck:
    """Check that every ``path`` in ``frame`` still exists before a job starts.

    A catalog outlives its files; a missing file found mid-epoch kills a long job.
    ``on_missing="drop"`` removes such rows and reports them -- never silently.
    """
    if on_missing not in ("raise", "drop"):
        raise ValueError(f"on_missing must be 'raise' or 'drop', got {on_missing!r}")
    paths = frame.select("path").to_pydict()["path"]
    missing = tuple(path for path in paths if not os.path.exists(path))
    if missing and on_missing == "raise":
        raise CatalogError(
            f"{len(missing)} catalog path(s) do not exist, first: {missing[0]}; regenerate the "
            f"dataset or pass on_missing='drop' to drop those rows (they are counted)"
        )
    kept = frame.where(~col("path").is_in(list(missing))) if missing else frame
    return PathCheck(frame=kept, checked=len(paths), missing=missing)


def bin_edges(bins: int) -> list[float]:
    """Left edges of :func:`quality_histogram`'s bins, for plotting."""
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    return [round(index / bins, 6) for index in range(bins)]



def total_bytes(frame: daft.DataFrame) -> int:
    """Bytes of all the images ``frame`` lists, from the catalog alone (no image is read)."""
    return int(frame.agg(col("bytes").sum()).to_pydict()["bytes"][0] or 0)


def decoded_inflation(frame: daft.DataFrame) -> float:
    """Decoded RGB bytes over JPEG bytes: how much larger an image gets once it is pixels."""
    totals = frame.agg(
        (col("width").cast(daft.DataType.int64()) * col("height") * 3).sum().alias("pixels"),
        col("bytes").sum().alias("jpeg"),
    ).to_pydict()
    return float(totals["pixels"][0]) / float(totals["jpeg"][0])


def decoded_bytes(paths: Iterable[str]) -> int:
    """Bytes of the uint8 RGB arrays the images at ``paths`` decode to: each is decoded with PIL and counted.

    :func:`decoded_inflation` reads what a decode *should* take from the catalog
    (width x height x 3); this decodes at full size and counts what it did take,
    so a catalog whose sizes no longer describe its files shows as a mismatch.
    """
    return sum(_decode_rgb(path).nbytes for path in paths)


def _decode_rgb(path: str) -> np.ndarray:
    """The image at ``path`` at full size, as a uint8 RGB array."""
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


@dataclass(frozen=True)
class DecodePeaks:
    """Peak resident memory added while decoding the same images kept all at once, or a batch at a time."""

    jpeg_bytes: int
    decoded_bytes: int
    materialised_bytes: int
    """Peak added while every decoded image is kept (a list of arrays, as a whole column in memory)."""
    streamed_bytes: int
    """Peak added while each batch is decoded, used and dropped before the next."""


def decode_peaks(paths: Iterable[str], *, batch: int = 32) -> DecodePeaks:
    """Decode ``paths`` twice at full size, keeping everything, then ``batch`` images at a time; measure both peaks.

    The peaks are the kernel's high-water mark (:class:`labkit.devices.PeakRss`) of a fresh process with
    :data:`labkit.fresh_process.PEAK_ALLOCATOR_ENV`, so they count what the arrays really took, and nothing earlier code left behind.
    """
    paths = list(paths)
    if not paths or batch < 1:
        raise ValueError(f"paths must name at least one image and batch must be >= 1, got {len(paths)} and {batch}")
    return DecodePeaks(**fresh_process.run_module("labkit.catalog", json.dumps({"paths": paths, "batch": batch}),
                                                   env=fresh_process.PEAK_ALLOCATOR_ENV, what="memory probe",
                                                   timeout_s=300))


def _decode_peaks_here(paths: list[str], batch: int) -> DecodePeaks:
    from labkit.devices import PeakRss

    with PeakRss() as materialised:
        kept = [_decode_rgb(path) for path in paths]
    decoded = sum(array.nbytes for array in kept)
    del kept
    with PeakRss() as streamed:
        for start in range(0, len(paths), batch):
            arrays = [_decode_rgb(path) for path in paths[start:start + batch]]
            del arrays
    return DecodePeaks(sum(os.path.getsize(path) for path in paths), decoded, materialised.added_bytes,
                       streamed.added_bytes)


def mean_by(frame: daft.DataFrame, key: str, value: str) -> dict[object, float]:
    """Mean of ``value`` per distinct ``key`` (e.g. quality of degraded vs clean images)."""
    table = frame.groupby(key).agg(col(value).mean().alias("mean")).to_pydict()
    return {k: float(m) for k, m in zip(table[key], table["mean"])}


if __name__ == "__main__":   # the fresh process of decode_peaks
    # Run through the importable module, not this __main__ copy of it, so a patched decoder is the one measured.
    from labkit import catalog

    _args = json.loads(sys.argv[1])
    print(json.dumps(asdict(catalog._decode_peaks_here(_args["paths"], _args["batch"]))))
