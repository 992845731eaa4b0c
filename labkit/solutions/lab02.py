"""Reference answers to Lab 2's exercises."""

import pyarrow.parquet as pq

from labkit.exercises import Answer

EX_2_1 = Answer(
    right=lambda workers, threads, latency_ms, decode_bound: min(decode_bound, workers * threads * 1e3 / latency_ms),
    wrong=lambda workers, threads, latency_ms, decode_bound: workers * 1e3 / latency_ms,
    wrong_because="one request in flight per worker: the threads are what keep more in flight",
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
