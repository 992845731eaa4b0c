"""How much one draw of failure arrivals moves Lab 8's measured goodput at each checkpoint interval.

``labkit.interval_runs`` draws its arrival points once per run (seed 0). At four times the Young/Daly
interval an interval is half the MTBF, so a loop's ~16 failures each lose anywhere from nothing to half an
MTBF of work, and the draw alone moves goodput by several percent. This replays the loops' rules step by
step at a constant step time (no machine noise: only the draw varies) and prints measured over modelled
goodput for seed 0 and for many other seeds.

    python benchmarks/interval_arrival_draws.py --seeds 600

The default costs are about what the loops measured in four runs on a 2-core CI machine (step 0.38-0.39 ms,
save 1.9-2.8 ms, reload 2.3-2.4 ms).
"""

from __future__ import annotations

import argparse
import statistics

from labkit.interval import goodput_fraction
from labkit.interval_runs import Arrivals, IntervalSizes, SIZES


def replay(factor: float, seed: int, sizes: IntervalSizes, step_s: float, save_s: float, reload_s: float) -> float:
    """Measured over modelled goodput of one loop that saves every ``factor`` x the optimum, as
    ``interval_runs._Loop`` runs it, with every step taking ``step_s``."""
    optimum_s = 2 * save_s * sizes.mtbf_over_optimum
    mtbf_s, interval_s = sizes.mtbf_over_optimum * optimum_s, factor * optimum_s
    share = 1.0 if factor == max(sizes.factors) else sizes.shorter_share   # as interval_runs.measure_here
    steps, arrivals = round(sizes.failures * share * mtbf_s / step_s), Arrivals(mtbf_s, seed)
    clock, position, saved_at, since_save_s, failures, stretch_s, stretches = 0.0, 0, 0, 0.0, 0, 0.0, 0
    while position < steps:
        clock, position, since_save_s = clock + step_s, position + 1, since_save_s + step_s
        if since_save_s >= interval_s or position >= steps:
            clock, saved_at = clock + save_s, position
            if since_save_s >= interval_s:
                stretch_s, stretches = stretch_s + since_save_s, stretches + 1
            since_save_s = 0.0
        if clock >= arrivals[failures] and position < steps:
            failures, position, clock, since_save_s = failures + 1, saved_at, clock + reload_s, 0.0
    return (steps * step_s / clock) / goodput_fraction(stretch_s / stretches, save_s, mtbf_s, reload_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=600, help="other seeds to replay (>= 2)")
    parser.add_argument("--step-ms", type=float, default=0.38)
    parser.add_argument("--save-ms", type=float, default=2.5)
    parser.add_argument("--reload-ms", type=float, default=2.3)
    args = parser.parse_args()
    if args.seeds < 2:
        parser.error(f"--seeds must be >= 2, got {args.seeds}")
    sizes = SIZES["ci"]
    costs = (args.step_ms / 1e3, args.save_ms / 1e3, args.reload_ms / 1e3)
    for factor in sizes.factors:
        ratios = [replay(factor, seed, sizes, *costs) for seed in range(1, args.seeds + 1)]
        print(f"x{factor:g} the optimum: seed 0 {replay(factor, 0, sizes, *costs):.3f}; {args.seeds} other seeds "
              f"{min(ratios):.3f}-{max(ratios):.3f}, mean {statistics.mean(ratios):.3f}, sd {statistics.stdev(ratios):.3f}")


if __name__ == "__main__":
    main()
