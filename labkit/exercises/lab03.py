"""Lab 3's exercises: overlap on a slower link; the roofline itself, as code, against measured points."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from labkit import intensity_sweep, microbench, overlap
from labkit.exercises import Verdict, check_code, predict

Roof = Callable[[float, float, float], float]


LINK_SLOWDOWN = 4
"""Exercise 3.2 divides the emulated link's rate by this. At a quarter of the link each copy takes about
twice a batch's compute on the CI box, so the copy lane sets the pace and the overlap rule holds. At half
the link the two lanes were within a few percent of each other: then every copy runs beside a compute,
the copy thread's bursts slowed the compute, and the overlapped run came out 15-29% over the rule in 3
of 20 runs of Lab 3 (2026-12-05 and 2026-12-07)."""


def quarter_link(result: overlap.OverlapResult, sizes: overlap.OverlapSizes, prediction,
                 device: torch.device | str = "cpu") -> Verdict | None:
    """Exercise 3.2: the overlapped pipeline's time with the emulated link at a quarter of its rate."""
    if sizes.link_bytes_per_s is None or torch.device(device).type != "cpu":
        print("Exercise 3.2 changes the emulated link's rate; here the link is real (a GPU's host link), so "
              "there is nothing to slow down. Try it on a CPU profile.")
        return None
    slower = replace(sizes, link_bytes_per_s=sizes.link_bytes_per_s / LINK_SLOWDOWN)
    batch_bytes = sizes.batch_rows * sizes.features * 4

    def explain(measured: float) -> str:
        copy_ms = batch_bytes / slower.link_bytes_per_s * 1e3
        compute_ms = result.serial.busy_ms("compute") / sizes.batches
        slower_side = "the copy" if copy_ms > compute_ms else "the compute"
        return (f"Per batch: copy {copy_ms:.2f} ms at {slower.link_bytes_per_s / 1e9:g} GB/s, compute "
                f"{compute_ms:.2f} ms (measured serially). Overlapped, {slower_side} sets the pace: one copy to "
                f"start, then {sizes.batches - 1} x max(copy, compute), then the last compute.")

    return predict("3.2", prediction, what=f"the overlapped time in ms at {slower.link_bytes_per_s / 1e9:g} GB/s",
                   measure=lambda: overlap.compare(device, slower).overlapped.total_ms,
                   context=(result, slower), tolerance=0.15, unit="ms", explain=explain)


def roof(sweep: intensity_sweep.IntensitySweep, answer) -> bool | None:
    """Exercise 3.1: ``attainable(intensity, peak_flops_per_s, bandwidth_bytes_per_s)`` against this device's
    measured sweep: no measured point above it, and never above the measured roofs."""
    peak, bandwidth = sweep.peak_flops_per_s, sweep.bandwidth_bytes_per_s

    def test(rule: Roof) -> str | None:
        for point in sweep.points:
            intensity, got = point.cost.intensity, point.flops_per_s
            yours = float(rule(intensity, peak, bandwidth))
            if got > 1.05 * yours * (microbench.WRITE_ALLOCATE_ALLOWANCE if intensity < sweep.ridge else 1.0):
                return (f"at {intensity:.2f} FLOP/byte this device measured {got / 1e9:.1f} GFLOP/s, above your "
                        f"roof of {yours / 1e9:.1f} (beyond what write-allocate explains): a roof nothing can beat "
                        "must be higher")
            ceiling = min(peak, intensity * bandwidth)
            if yours > 1.05 * ceiling:
                return (f"at {intensity:.2f} FLOP/byte your roof says {yours / 1e9:.1f} GFLOP/s, but the memory "
                        f"delivers only {intensity * bandwidth / 1e9:.1f} and the units compute at most "
                        f"{peak / 1e9:.1f}")
        return None

    return check_code("3.1", answer, what="a function attainable(intensity, peak_flops_per_s, "
                      "bandwidth_bytes_per_s) -> FLOP/s", test=test)
