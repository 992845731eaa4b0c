"""Reference answers to Lab 2's exercises."""

import pyarrow.parquet as pq

from labkit import representations
from labkit.exercises import Answer

EX_2_1 = Answer(
    right=lambda images, rows_per_group: representations.expected_requests(images, rows_per_group),
    wrong=lambda images, rows_per_group: images,
    wrong_because="one request per image: that is the files representation",
)


def _groups(metadata: pq.FileMetaData, column: str, at_most: int) -> list[int]:
    """Keep a row group unless its minimum already exceeds the bound: its statistics rule it out."""
    index = metadata.schema.names.index(column)
    return [i for i in range(metadata.num_row_groups) if metadata.row_group(i).column(index).statistics.min <= at_most]


def _wholly_inside(metadata: pq.FileMetaData, column: str, at_most: int) -> list[int]:
    index = metadata.schema.names.index(column)
    return [i for i in range(metadata.num_row_groups) if metadata.row_group(i).column(index).statistics.max <= at_most]


EX_2_2 = Answer(
    right=_groups,
    wrong=_wholly_inside,
    wrong_because="keeps only row groups whose every row matches, and so misses the group the bound cuts through",
)
