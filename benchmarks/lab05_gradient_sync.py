"""Lab 5 targets: counted bytes vs the ring model, collective bandwidth, delayed sync over shaped links.

    python benchmarks/lab05_gradient_sync.py                      # 2 ranks, every part, one run
    python benchmarks/lab05_gradient_sync.py --parts gradsync --runs 10 --no-deepspeed
    LABKIT_FABRIC=emulated python benchmarks/lab05_gradient_sync.py --parts gradsync

The gradsync part calls what Lab 5 calls (``gradsync.run_experiment``, ``print_table``):
one rank per node of a labkit.fabric with real tbf-shaped links where the fabric
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

from labkit import collective_bench, collectives, gradsync, gradsync_model, profile, tensor_parallel
from labkit.devices import describe_machine

PARTS = ("counts", "gradsync", "tp")


def counts_and_bandwidth(world_size: int) -> None:
    numel = 3000
    start = time.perf_counter()
    results = collective_bench.run_count_and_benchmark(world_size, numel)
    print(f"\n== {world_size} ranks: counted bytes vs ring model (launch {time.perf_counter() - start:.1f} s)")
    for op in collectives.OPS:
        message = collective_bench.expected_message_bytes(op, numel, world_size)
        model = collectives.ring_bytes_per_rank(op, message, world_size)
        counted = [r["counted"]["counts"][op]["ring_bytes"] for r in results]
        verdict = "MATCH" if all(c == model for c in counted) else "MISMATCH"
        print(f"{op:>15}: message {message:>7} B  model {model:>7} B/rank  counted {counted}  {verdict}")
    print(f"-- bandwidth ({results[0]['benchmark'][0]['backend']}), nccl-tests definitions")
    print(f"{'op':>15} {'bytes':>10} {'time_us':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}")
    for row in results[0]["benchmark"]:
        print(f"{row['op']:>15} {row['message_bytes']:>10} {row['time_us']:>10.0f} "
              f"{row['algbw_gbytes_per_s']:>11.3f} {row['busbw_gbytes_per_s']:>11.3f}")


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
        for row in result["rows"]:
            ratios.setdefault((row["rate_gbit"], row["mode"]), []).append(row["measured_over_model"])
        rows, slowest = result["rows"], min(rates_gbit)
        shaped = [rate for rate in rates_gbit if rate < max(gradsync.RATES_GBIT)]
        held["delayed faster than sync-every at every rate below 100 Gbit/s"] += all(
            gradsync_model.find_row(rows, rate_gbit=rate, mode="delayed_sync")["ms_per_sample"]
            < gradsync_model.find_row(rows, rate_gbit=rate, mode="sync_every_micro_step")["ms_per_sample"]
            for rate in shaped
        )
        held["sync-every slower than one rank alone at the slowest rate"] += (
            gradsync_model.find_row(rows, rate_gbit=slowest, mode="sync_every_micro_step")["ms_per_sample"]
            > result["single_device"]["ms_per_sample"]
        )
        for ds in result.get("deepspeed", []):
            print(f"DeepSpeed ZeRO-{ds['stage']}: calls per micro-step {ds['calls_per_micro_step']}; "
                  f"message bytes per optimizer step {ds['message_bytes_per_optimizer_step']}")
    print(f"\n== measured / model over {runs} runs (min, median, max)")
    for (rate, mode), values in ratios.items():
        values = sorted(values)
        print(f"{gradsync_model.rate_label(rate):>22} {mode:>22}: {values[0]:.3f} {statistics.median(values):.3f} {values[-1]:.3f}")
    for name, count in held.items():
        print(f"{name}: held {count}/{runs}")


def tensor_parallel_check(world_size: int) -> None:
    result = tensor_parallel.run_tensor_parallel(world_size)
    print(f"\n== {world_size} ranks: tensor-parallel MLP, {result['layers']} layers")
    print(f"all_reduce {result['counts']['all_reduce']}, max output error {result['max_output_error']:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--runs", type=int, default=1, help="repeats of the gradsync experiment, for the spread")
    parser.add_argument("--rates", type=float, nargs="+", default=list(gradsync.RATES_GBIT), help="link rates, Gbit/s")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed's collective counts")
    args = parser.parse_args()
    print(profile().describe(), describe_machine())
    for world_size in args.world_sizes:
        if "counts" in args.parts:
            counts_and_bandwidth(world_size)
        if "gradsync" in args.parts:
            delayed_sync(world_size, args.runs, args.rates, not args.no_deepspeed)
        if "tp" in args.parts:
            tensor_parallel_check(world_size)


if __name__ == "__main__":
    main()
