"""Lab 5 targets: counted bytes vs the ring model, collective bandwidth, delayed sync under emulated links.

    python benchmarks/lab05_gradient_sync.py                  # 2 and 4 ranks, every part
    python benchmarks/lab05_gradient_sync.py --world-sizes 2 --parts counts

Prints figures; asserts nothing beyond reporting MATCH / MISMATCH (the tests and
the notebook hold the asserts). Uses gloo ranks on the CPU, NCCL on a multi-GPU
profile (``LABKIT_PROFILE=multi-gpu``).
"""

from __future__ import annotations

import argparse
import time

from labkit import collectives, gradsync, parallelism, profile
from labkit.devices import describe_machine

PARTS = ("counts", "gradsync", "tp")


def counts_and_bandwidth(world_size: int) -> None:
    numel = 3000
    start = time.perf_counter()
    results = collectives.run_count_and_benchmark(world_size, numel)
    print(f"\n== {world_size} ranks: counted bytes vs ring model (launch {time.perf_counter() - start:.1f} s)")
    for op in collectives.OPS:
        message = collectives.expected_message_bytes(op, numel, world_size)
        model = collectives.ring_bytes_per_rank(op, message, world_size)
        counted = [r["counted"]["counts"][op]["ring_bytes"] for r in results]
        verdict = "MATCH" if all(c == model for c in counted) else "MISMATCH"
        print(f"{op:>15}: message {message:>7} B  model {model:>7} B/rank  counted {counted}  {verdict}")
    print(f"-- bandwidth ({results[0]['benchmark'][0]['backend']}), nccl-tests definitions")
    print(f"{'op':>15} {'bytes':>10} {'time_us':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}")
    for row in results[0]["benchmark"]:
        print(f"{row['op']:>15} {row['message_bytes']:>10} {row['time_us']:>10.0f} "
              f"{row['algbw_gbytes_per_s']:>11.3f} {row['busbw_gbytes_per_s']:>11.3f}")


def delayed_sync(world_size: int) -> None:
    start = time.perf_counter()
    result = gradsync.run_experiment(world_size, deepspeed_stages=(1, 2))
    print(f"\n== {world_size} ranks: DDP under emulated links (launch {time.perf_counter() - start:.1f} s)")
    single = result["single_device"]
    print(f"one rank alone: {single['samples_per_s']:.1f} samples/s")
    for row in result["ddp"]:
        print(f"{row['link']:>16} {row['mode']:>22} acc={row['accumulation']:<2} "
              f"all-reduces/step={row['all_reduce_calls_per_step']:>5.1f} "
              f"ring bytes/step={row['ring_bytes_per_step']:>10.0f} step={row['step_s'] * 1e3:7.1f} ms "
              f"{row['samples_per_s']:8.1f} samples/s")
    for ds in result["deepspeed"]:
        print(f"DeepSpeed ZeRO-{ds['stage']}: calls per micro-step {ds['calls_per_micro_step']}")


def tensor_parallel(world_size: int) -> None:
    result = parallelism.run_tensor_parallel(world_size)
    print(f"\n== {world_size} ranks: tensor-parallel MLP, {result['layers']} layers")
    print(f"all_reduce {result['counts']['all_reduce']}, max output error {result['max_output_error']:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    args = parser.parse_args()
    print(profile().describe(), describe_machine())
    for world_size in args.world_sizes:
        if "counts" in args.parts:
            counts_and_bandwidth(world_size)
        if "gradsync" in args.parts:
            delayed_sync(world_size)
        if "tp" in args.parts:
            tensor_parallel(world_size)


if __name__ == "__main__":
    main()
