"""Reference answers to Lab 5's exercises."""

from labkit.exercises import Answer

EX_5_1 = Answer(
    right=lambda gbit, mib, ranks: 2 * (ranks - 1) / ranks * mib * 2**20 * 8 / (gbit * 1e9) * 1e3,
    wrong=lambda gbit, mib, ranks: (ranks - 1) / ranks * mib * 2**20 * 8 / (gbit * 1e9) * 1e3,
    wrong_because="counts one pass of the ring; an all-reduce is a reduce-scatter and an all-gather",
)


def _buckets(sizes: list[int], cap: int) -> list[list[int]]:
    """Greedy, last layer first (the order backward produces gradients), closing a bucket at the cap."""
    buckets: list[list[int]] = [[]]
    filled = 0
    for index in reversed(range(len(sizes))):
        if buckets[-1] and filled + sizes[index] > cap:
            buckets.append([])
            filled = 0
        buckets[-1].append(index)
        filled += sizes[index]
    return buckets


def _forward_buckets(sizes: list[int], cap: int) -> list[list[int]]:
    """The same greedy rule, first layer first: the order the model registers its parameters."""
    return [list(reversed(bucket)) for bucket in reversed(_buckets(sizes, cap))]


EX_5_2 = Answer(
    right=_buckets,
    wrong=_forward_buckets,
    wrong_because="forward order: the first bucket holds the first layer's gradients, which backward produces last",
)
