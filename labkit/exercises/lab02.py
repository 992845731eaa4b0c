"""Lab 2's exercises: requests for a packed file at another row-group size; the row groups a filter reads."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

import daft
import pyarrow.parquet as pq

from labkit import representations
from labkit.exercises import Verdict, check_code, predict
from labkit.objectstore import ObjectStore

GroupRule = Callable[[pq.FileMetaData, str, int], list[int]]


def packed_requests(selected: daft.DataFrame, images: int, prediction, *, rows_per_group: int = 32,
                    first_byte_ms: float = 10.0) -> Verdict | None:
    """Exercise 2.1: data requests to read ``images`` images from a file packed ``rows_per_group`` to a group."""
    def measure() -> float:
        with tempfile.TemporaryDirectory(prefix="labkit-exercise-") as folder:
            packed = representations.write_packed(selected, Path(folder) / "packed.parquet",
                                                  rows_per_group=rows_per_group)
            with ObjectStore(folder, first_byte_ms=first_byte_ms) as store:
                fetched = representations.fetch_parquet(store, packed.path, name="packed", max_images=images)
            return fetched.data_requests

    return predict("2.1", prediction, what=f"the data requests (footer and HEAD not counted) to read {images} "
                   f"images packed {rows_per_group} to a row group", measure=measure,
                   context=(images, rows_per_group), tolerance=0.0, unit="requests",
                   explain=lambda got: f"One ranged GET per row group: ceil({images} / {rows_per_group}). Each pays "
                                       f"the {first_byte_ms:g} ms first byte once, instead of once per image.")


def row_groups(path: str | Path, answer, *, column: str = "image_id") -> bool | None:
    """Exercise 2.2: ``groups(metadata, column, at_most)``: the row groups a scan for ``column <= at_most`` reads."""
    metadata = pq.ParquetFile(path).metadata
    values = pq.read_table(path, columns=[column]).column(column)
    offsets = [0]
    for index in range(metadata.num_row_groups):
        offsets.append(offsets[-1] + metadata.row_group(index).num_rows)
    per_group = [values.slice(offsets[i], offsets[i + 1] - offsets[i]).to_pylist()
                 for i in range(metadata.num_row_groups)]
    first, last = min(per_group[0]), max(per_group[-1])
    middle = per_group[len(per_group) // 2]
    thresholds = (first - 1, max(per_group[0]), min(middle) + (max(middle) - min(middle)) // 2, last)

    def test(rule: GroupRule) -> str | None:
        for at_most in thresholds:
            needed = sorted(i for i, group in enumerate(per_group) if min(group) <= at_most)
            chosen = sorted(set(rule(metadata, column, at_most)))
            if missing := set(needed) - set(chosen):
                return f"for {column} <= {at_most} it skips row group(s) {sorted(missing)}, which hold matching rows"
            if len(chosen) > len(needed):
                return (f"for {column} <= {at_most} it reads {len(chosen)} row groups where the statistics "
                        f"rule out all but {len(needed)}")
        return None

    return check_code("2.2", answer, what="a function groups(metadata, column, at_most) -> list of row group indices",
                      test=test)
