"""Lab 6 targets: ZeRO-3 vs ZeRO++ on 2 nodes x 2 ranks of a labkit.fabric (real shaped links).

Calls what the notebook calls (``zeropp_fabric.run``; ``zeropp_model.bytes_table``, ``time_table``,
``speedup`` and the rows' ``describe``; ``zeropp_deepspeed.run`` with ``--deepspeed``) and checks the
issue's targets:
- cross-node bytes from the links' kernel counters within 1% of the per-link model, every variant;
- ZeRO++ (qwZ + hpZ + qgZ) / ZeRO-3 (bf16 on the wire) cross-node bytes <= 0.30;
- at the slowest link and the small micro-batch ZeRO++ is faster, and the advantage shrinks as the
  link gets faster;
- at the middle rate ZeRO++'s speedup at the small micro-batch is >= 1.5x its speedup at the big one;
- ZeRO-3's step on the slowest link within 0.7-1.15x the model (compute on an unshaped link plus the
  measured wire bytes at the rate).
Where fabric.probe() says "emulated" the same run uses Lab 5's emulation and says so.
Prints the load average beside the timings: four ranks share the cores. Exit status 1 when a
target is missed. ``--repeats N`` reruns and prints the spread the notebook's band comes from.

    python benchmarks/lab06_quantized_collectives.py [--rates 0.05 0.2 0.8] [--repeats 3] [--deepspeed]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from labkit import profile, zeropp_deepspeed, zeropp_fabric, zeropp_model, zeropp_speedup
from labkit.devices import describe_machine


def one_run(rates: tuple[float, ...]) -> tuple[bool, float]:
    load = os.getloadavg()[0]
    start = time.perf_counter()
    r = zeropp_fabric.run(rates_gbit=rates)
    print(f"\n{r.describe()}\nrun took {time.perf_counter() - start:.0f} s, "
          f"load average {load:.1f} before, {os.getloadavg()[0]:.1f} after")
    print("cross-node bytes per step, busiest link (M = 16-bit model bytes)")
    rows = {row.variant: row for row in zeropp_model.bytes_table(r)}
    for row in rows.values():
        print(" ", row.describe())
    ok = all(1.0 <= row.payload_vs_model <= 1.01 for row in rows.values())
    ok &= rows["ZeRO++"].wire_vs_zero3 <= 0.30
    print(f"  ZeRO++ / ZeRO-3: {rows['ZeRO++'].wire_vs_zero3:.3f} (target <= 0.30)")
    print("ms per step (median, slowest rank) and the model")
    table = zeropp_model.time_table(r)
    for t in table:
        print(" ", t.describe())
    small = r.micro_batches[0]
    for micro_batch in r.micro_batches:
        print(" ", zeropp_model.speedup_text(r, micro_batch))
    speedups = zeropp_model.speedup(r, small)
    ok &= speedups[0] > 1 and speedups[0] > speedups[-1]
    effect = zeropp_speedup.micro_batch_effect(r)
    print(" ", effect.describe(), f"(target >= {zeropp_speedup.MICRO_BATCH_FLOOR})")
    ok &= effect.ratio >= zeropp_speedup.MICRO_BATCH_FLOOR
    slowest = next(t for t in table if t.variant == "ZeRO-3" and t.micro_batch == small
                   and t.rate_gbit == r.rates_gbit[0])
    ok &= 0.7 <= slowest.measured_vs_model <= 1.15
    return ok, slowest.measured_vs_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=None, help="link rates, Gbit/s (profile's default)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--deepspeed", action="store_true", help="also DeepSpeed's ZeRO-3 and hpZ on the fabric")
    args = parser.parse_args(argv)
    print(profile().describe())
    print(describe_machine())
    rates = tuple(args.rates) if args.rates else profile().pick(zeropp_fabric.SIZES).rates_gbit
    results = [one_run(rates) for _ in range(args.repeats)]
    ok = all(passed for passed, _ in results)
    ratios = [ratio for _, ratio in results]
    print(f"\nZeRO-3 on the slowest link, measured / model over {len(ratios)} runs: "
          f"{min(ratios):.2f}-{max(ratios):.2f} (band 0.7-1.15)")
    if args.deepspeed:
        ds = zeropp_deepspeed.run()
        for d in ds.values():
            print("DeepSpeed", d.describe())
        ok &= ds["hpZ"].cross_node_bytes_per_step < 0.8 * ds["ZeRO-3"].cross_node_bytes_per_step
    print("\nALL TARGETS MET" if ok else "\nSOME TARGETS MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
