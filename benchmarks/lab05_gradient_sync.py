"""Lab 5 targets: counted bytes vs the ring model, collective bandwidth, delayed sync over shaped links.

    python benchmarks/lab05_gradient_sync.py                      # 2 ranks, every part, one run
    python benchmarks/lab05_gradient_sync.py --parts gradsync --runs 10 --no-deepspeed
    python benchmarks/lab05_gradient_sync.py --parts crossover overlap --runs 5
    LABKIT_FABRIC=emulated python benchmarks/lab05_gradient_sync.py --parts gradsync

Every part calls what Lab 5 calls (``run_count_and_benchmark``, ``print_counts``,
``print_benchmark``; ``gradsync.run_experiment``, ``print_table``, ``print_stage_counts``).
The gradsync part puts one rank per node of a labkit.fabric with real tbf-shaped links where the fabric
can be built (root), the sleep emulation elsewhere; each table names its mode.
With ``--runs`` it prints the spread of measured / model per row and how often
the lesson's orderings held. Prints figures; asserts nothing beyond reporting
MATCH / MISMATCH (the tests and the notebook hold the asserts).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from labkit import (collective_bench, ddp_overlap, ddp_overlap_model, gradsync, gradsync_crossover, gradsync_deepspeed,
                    gradsync_model, profile, tensor_parallel)
from labkit.devices import describe_machine

PARTS = ("counts", "gradsync", "crossover", "overlap", "tp")


def counts_and_bandwidth(world_size: int) -> None:
    numel = 3000
    start = time.perf_counter()
    lab = collective_bench.run_count_and_benchmark(world_size, numel)
    print(f"\n== {world_size} ranks: counted bytes vs ring model (launch {time.perf_counter() - start:.1f} s)")
    collective_bench.print_counts(lab, numel)
    print("-- bandwidth")
    collective_bench.print_benchmark(lab[0].benchmark)


def delayed_sync(world_size: int, runs: int, rates_gbit: list[float], deepspeed: bool) -> None:
    ratios: dict[tuple[float, str], list[float]] = {}
    held = {"delayed faster than sync-every at every rate below 100 Gbit/s": 0,
            "sync-every slower than one rank alone at the slowest rate": 0}
    for run in range(runs):
        start = time.perf_counter()
        result = gradsync.run_experiment(world_size, rates_gbit=rates_gbit, deepspeed_stages=(1, 2) if deepspeed else ())
        print(f"\n== run {run + 1}/{runs}, {world_size} ranks one per node: launch {time.perf_counter() - start:.1f} s, "
              f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
        gradsync_model.print_table(result)
        for row in result.rows:
            ratios.setdefault((row.rate_gbit, row.mode), []).append(row.measured_over_model)
        slowest = min(rates_gbit)
        shaped = [rate for rate in rates_gbit if rate < max(gradsync.RATES_GBIT)]
        held["delayed faster than sync-every at every rate below 100 Gbit/s"] += all(
            result.row(rate, "delayed_sync").ms_per_sample < result.row(rate, "sync_every_micro_step").ms_per_sample
            for rate in shaped
        )
        held["sync-every slower than one rank alone at the slowest rate"] += (
            result.row(slowest, "sync_every_micro_step").ms_per_sample > result.single_device.ms_per_sample
        )
        gradsync_deepspeed.print_stage_counts(result.deepspeed)
    print(f"\n== measured / model over {runs} runs (min, median, max)")
    for (rate, mode), values in ratios.items():
        values = sorted(values)
        print(f"{gradsync_model.rate_label(rate):>22} {mode:>22}: {values[0]:.3f} {statistics.median(values):.3f} {values[-1]:.3f}")
    for name, count in held.items():
        print(f"{name}: held {count}/{runs}")


def crossover(world_size: int, runs: int) -> None:
    """Two ranks against one as the window grows: the ceiling and the longest window, per run."""
    print(f"\n== crossover, {world_size} ranks, {runs} run(s)")
    for run in range(runs):
        xo = gradsync_crossover.run_crossover(world_size)
        longest = xo.samples_per_s(xo.longest)
        print(f"run {run + 1}: ceiling {xo.ceiling_samples_per_s / xo.alone_samples_per_s:.2f}x one rank; window "
              f"{xo.longest} {longest / xo.alone_samples_per_s:.2f}x one rank, {longest / xo.ceiling_samples_per_s:.0%} "
              f"of the ceiling; crossover measured {xo.measured_crossover_window()}, modelled "
              f"{xo.predicted_crossover_window():.1f} ({xo.link_mode.label})")


def overlap(world_size: int, runs: int) -> None:
    """DDP's buckets: each layout's wait against the model, and small buckets' share of the one-bucket wait."""
    print(f"\n== overlap, {world_size} ranks, {runs} run(s)")
    for run in range(runs):
        result = ddp_overlap.run_overlap(world_size)
        ratios = ", ".join(f"{v} {result.exposed_s(v) / result.modelled_exposed_s(v):.2f}x the model"
                           for v in ddp_overlap_model.VARIANTS)
        print(f"run {run + 1}: {ratios}; small buckets waited {result.exposed_share('small buckets'):.0%} of the "
              f"one-bucket wait ({result.link_mode.label})")


def tensor_parallel_check(world_size: int) -> None:
    print(f"\n== tensor-parallel MLP: {tensor_parallel.run_tensor_parallel(world_size).describe()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--runs", type=int, default=1, help="repeats of the gradsync, crossover and overlap "
                        "experiments, for the spread")
    parser.add_argument("--rates", type=float, nargs="+", default=list(gradsync.RATES_GBIT), help="link rates, Gbit/s")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed's collective counts")
    args = parser.parse_args()
    print(profile().describe(), describe_machine())
    for world_size in args.world_sizes:
        if "counts" in args.parts:
            counts_and_bandwidth(world_size)
        if "gradsync" in args.parts:
            delayed_sync(world_size, args.runs, args.rates, not args.no_deepspeed)
        if "crossover" in args.parts:
            crossover(world_size, args.runs)
        if "overlap" in args.parts:
            overlap(world_size, args.runs)
        if "tp" in args.parts:
            tensor_parallel_check(world_size)


if __name__ == "__main__":
    main()
