"""Collectives measured on real ranks: bus bandwidth per message size, and every call counted.

:func:`run_benchmark` times each collective over a sweep of message sizes (the
nccl-tests way: algorithm and bus bandwidth); :func:`run_count_and_benchmark`
also runs each operation once under a :class:`labkit.collectives.CommCounter` so
the bytes the counter saw can be checked against the ring model
(:func:`expected_message_bytes`). Rank functions send back plain dictionaries;
:func:`run_count_and_benchmark` turns each rank's into a :class:`RankCollectives`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from labkit.collectives import (LINKS, OPS, CommCounter, OpCount, bus_bandwidth_factor, check_op,
                                counting_wrappers_removed, ring_bytes_per_rank)
from labkit.launcher import rank_device
from labkit.profiles import profile, require_at_least


@dataclass(frozen=True)
class BenchSizes:
    """Message sizes to time each collective at, and timed calls per size."""

    message_bytes: tuple[int, ...]
    repeats: int

    def __post_init__(self) -> None:
        if not self.message_bytes or min(self.message_bytes) < 1:
            raise ValueError(f"BenchSizes.message_bytes must be one or more sizes >= 1, got {self.message_bytes}")
        require_at_least(self, 1, "repeats")


SIZES = {
    "ci": BenchSizes(message_bytes=(2**12, 2**16, 2**20, 2**22), repeats=5),
    "gpu": BenchSizes(message_bytes=(2**12, 2**16, 2**20, 2**22, 2**24), repeats=10),
    "multi-gpu": BenchSizes(message_bytes=(2**12, 2**16, 2**20, 2**24, 2**26, 2**28), repeats=20),
}

BENCHMARK_OPS = ("all_reduce", "all_gather", "reduce_scatter")


@dataclass(frozen=True)
class BenchRow:
    """One collective at one message size: the slowest rank's mean time per call, and nccl-tests' bandwidths."""

    op: str
    message_bytes: int
    time_us: float
    algbw_gbytes_per_s: float
    busbw_gbytes_per_s: float


@dataclass(frozen=True)
class Benchmark:
    """Every collective timed over the message-size sweep, on ``world_size`` ranks of ``backend``."""

    backend: str
    world_size: int
    rows: tuple[BenchRow, ...]

    def for_op(self, op: str) -> list[BenchRow]:
        """``op``'s rows, smallest message first: latency-bound at the start, bandwidth-bound at the end."""
        check_op(op)
        return sorted((row for row in self.rows if row.op == op), key=lambda row: row.message_bytes)


@dataclass(frozen=True)
class CountedCalls:
    """What one rank's :class:`CommCounter` saw, per op: calls, message bytes, ring bytes."""

    rank: int
    world_size: int
    counts: dict[str, OpCount]
    emulated_s: float
    wall_s: float
    wrappers_removed: bool


@dataclass(frozen=True)
class RankCollectives:
    """One rank's share of :func:`run_count_and_benchmark`: its counted calls, and the (shared) benchmark."""

    counted: CountedCalls
    benchmark: Benchmark


def _run_op(op: str, message_bytes: int, world_size: int, device: torch.device) -> Callable[[], None]:
    numel = max(message_bytes // 4 // world_size, 1) * world_size
    full = torch.ones(numel, device=device)
    shard = torch.ones(numel // world_size, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full)
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(full, shard)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(shard, full)
    if op == "all_to_all":
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full)
    return lambda: dist.broadcast(full, src=0)


def bandwidths_gbytes_per_s(op: str, message_bytes: int, world_size: int, time_s: float) -> tuple[float, float]:
    """(algbw, busbw) in GB/s as nccl-tests defines them: algbw = size / time, busbw = algbw x factor."""
    if time_s <= 0:
        raise ValueError(f"time_s must be > 0, got {time_s}")
    algbw = message_bytes / time_s / 1e9
    return algbw, algbw * bus_bandwidth_factor(op, world_size)


def benchmark_rank(
    message_bytes: Sequence[int] | None = None,
    ops: Sequence[str] = BENCHMARK_OPS,
    repeats: int | None = None,
    warmup: int = 2,
) -> list[dict[str, Any]]:
    """Rank function: time each collective per message size on the real fabric.

    Times are the slowest rank's mean per call (a collective is done when its
    last rank is), with the device synchronised around the timed loop.
    """
    from labkit.devices import synchronize

    sizes = profile().pick(SIZES)
    message_bytes = list(message_bytes or sizes.message_bytes)
    repeats = repeats or sizes.repeats
    device = rank_device()
    world_size = dist.get_world_size()
    rows = []
    for op in ops:
        check_op(op)
        for size in message_bytes:
            run = _run_op(op, size, world_size, device)
            for _ in range(warmup):
                run()
            synchronize(device)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(repeats):
                run()
            synchronize(device)
            elapsed = torch.tensor([(time.perf_counter() - start) / repeats], dtype=torch.float64, device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            actual_bytes = max(size // 4 // world_size, 1) * world_size * 4
            algbw, busbw = bandwidths_gbytes_per_s(op, actual_bytes, world_size, elapsed.item())
            rows.append(
                {
                    "op": op,
                    "message_bytes": actual_bytes,
                    "world_size": world_size,
                    "time_us": elapsed.item() * 1e6,
                    "algbw_gbytes_per_s": algbw,
                    "busbw_gbytes_per_s": busbw,
                    "backend": dist.get_backend(),
                }
            )
    return rows


def run_benchmark(world_size: int = 2, **kwargs: Any) -> list[dict[str, Any]]:
    """Launch ``benchmark_rank`` on ``world_size`` real ranks (gloo here, NCCL on GPUs)."""
    from labkit.launcher import launch

    if world_size < 2:
        raise ValueError(f"world_size must be >= 2 for a collective benchmark, got {world_size}")
    return launch(benchmark_rank, world_size, backend=profile().backend_for(world_size), **kwargs)[0]


def count_collectives_rank(
    numel_per_rank: int,
    ops: Sequence[str] = BENCHMARK_OPS,
    link_name: str | None = None,
    repeats: int = 1,
    async_op: bool = False,
) -> dict[str, Any]:
    """Rank function: issue each op ``repeats`` times on fp32 tensors and return the counter.

    With ``async_op`` every call is issued asynchronously and then waited on, the
    path overlapping frameworks take (the emulated delay is added at ``wait``).

    The tensors are sized so every op's *message* is ``numel_per_rank * N`` fp32
    elements except all-reduce, broadcast and all-to-all, whose message is the
    ``numel_per_rank``-element input: callers compare the counts with the model.
    """
    if numel_per_rank < 1:
        raise ValueError(f"numel_per_rank must be >= 1, got {numel_per_rank}")
    world_size = dist.get_world_size()
    device = rank_device()
    shard = torch.ones(numel_per_rank, device=device)
    full = torch.ones(numel_per_rank * world_size, device=device)
    calls = {
        "all_reduce": lambda: dist.all_reduce(shard, async_op=async_op),
        "all_gather": lambda: dist.all_gather_into_tensor(full, shard, async_op=async_op),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full, async_op=async_op),
        "all_to_all": lambda: dist.all_to_all_single(torch.empty_like(full), full, async_op=async_op),
        "broadcast": lambda: dist.broadcast(shard, src=0, async_op=async_op),
    }
    link = LINKS[link_name] if link_name else None
    dist.barrier()
    start = time.perf_counter()
    with CommCounter(link=link) as counter:
        for _ in range(repeats):
            for op in ops:
                check_op(op)
                work = calls[op]()
                if async_op:
                    work.wait()
    wall_s = time.perf_counter() - start
    restored = counting_wrappers_removed()
    return {
        **counter.as_dict(),
        "wall_s": wall_s,
        "world_size": world_size,
        "rank": dist.get_rank(),
        "wrappers_removed": restored,
    }


def count_and_benchmark_rank(
    numel_per_rank: int, message_bytes: Sequence[int] | None = None, repeats: int | None = None
) -> dict[str, Any]:
    """Rank function: the counting check and the bandwidth benchmark in one launch (launches cost seconds)."""
    return {
        "counted": count_collectives_rank(numel_per_rank, ops=OPS),
        "benchmark": benchmark_rank(message_bytes, repeats=repeats),
    }


def run_count_and_benchmark(world_size: int = 2, numel_per_rank: int = 3000, **kwargs: Any) -> list[RankCollectives]:
    """Launch :func:`count_and_benchmark_rank` on real ranks; every rank's result, in rank order."""
    from labkit.launcher import launch

    if world_size < 2:
        raise ValueError(f"world_size must be >= 2 to count collectives between ranks, got {world_size}")
    if numel_per_rank < 1:
        raise ValueError(f"numel_per_rank must be >= 1, got {numel_per_rank}")
    results = launch(count_and_benchmark_rank, world_size, backend=profile().backend_for(world_size),
                     numel_per_rank=numel_per_rank, **kwargs)
    return [RankCollectives(_counted_calls(r["counted"]), _benchmark(r["benchmark"])) for r in results]


def _counted_calls(counted: dict[str, Any]) -> CountedCalls:
    return CountedCalls(rank=counted["rank"], world_size=counted["world_size"],
                        counts={op: OpCount(**c) for op, c in counted["counts"].items()},
                        emulated_s=counted["emulated_s"], wall_s=counted["wall_s"],
                        wrappers_removed=counted["wrappers_removed"])


def _benchmark(rows: list[dict[str, Any]]) -> Benchmark:
    fields = ("op", "message_bytes", "time_us", "algbw_gbytes_per_s", "busbw_gbytes_per_s")
    return Benchmark(backend=rows[0]["backend"], world_size=rows[0]["world_size"],
                     rows=tuple(BenchRow(**{key: row[key] for key in fields}) for row in rows))


def expected_message_bytes(op: str, numel_per_rank: int, world_size: int) -> int:
    """The message size ``count_collectives_rank`` issues for ``op`` (fp32)."""
    check_op(op)
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return 4 * numel_per_rank * world_size
    return 4 * numel_per_rank


def print_counts(lab: Sequence[RankCollectives], numel_per_rank: int) -> None:
    """Per op: the message each rank issued, the ring model's bytes per rank, and what every rank's counter saw."""
    n = lab[0].counted.world_size
    for op in OPS:
        message = expected_message_bytes(op, numel_per_rank, n)
        model = ring_bytes_per_rank(op, message, n)
        counted = [r.counted.counts[op].ring_bytes for r in lab]
        calls = [r.counted.counts[op].calls for r in lab]
        verdict = "MATCH" if all(c == model for c in counted) else "MISMATCH"
        print(f"{op:>15}: message {message:>7} B  model {model:>7} B/rank  counted {counted} in {calls} calls  {verdict}")


def print_benchmark(bench: Benchmark) -> None:
    """The sweep as nccl-tests prints it: time per call, algorithm and bus bandwidth, per op and message size."""
    print(f"{bench.backend} on {bench.world_size} ranks; algbw = bytes / time, busbw = algbw x the op's ring factor")
    print(f"{'op':>15} {'bytes':>10} {'time_us':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}")
    for row in bench.rows:
        print(f"{row.op:>15} {row.message_bytes:>10} {row.time_us:>10.0f} "
              f"{row.algbw_gbytes_per_s:>11.3f} {row.busbw_gbytes_per_s:>11.3f}")
