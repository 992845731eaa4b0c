"""Lab 3 targets: do the microbenchmarks measure the device, not the harness?

Compares labkit.microbench's peak matmul FLOP/s and peak bandwidth with a bare
loop of ``a @ b`` and of ``dst.copy_(src)`` at the same sizes on the same device
(target: >= 80% of each). On a GPU also prints both as fractions of the vendor
sheet. Then times the notebook's three experiments once. Run:

    python benchmarks/lab03_memory_movement.py            # profile from LABKIT_PROFILE / the machine
"""

from __future__ import annotations

import time

import torch

from labkit import fusion, microbench, overlap, profile, reference_loops, roofline_devices
from labkit.devices import describe_machine, load_average, pick_device

TARGET_FRACTION = 0.80


def main() -> int:
    prof = profile()
    device = pick_device(prof.device)
    sizes = microbench.sizes()
    print(prof.describe())
    print(describe_machine())
    failures = []

    start = time.perf_counter()
    peaks = microbench.measure_peaks(device, sizes)
    print(f"microbench: measured peaks in {time.perf_counter() - start:.1f} s")

    plain_copy = max(reference_loops.plain_copy_bytes_per_s(device, sizes.bandwidth_numel) for _ in range(3))
    fraction = peaks.bandwidth_bytes_per_s / plain_copy
    print(f"bandwidth: microbench {peaks.bandwidth_bytes_per_s / 1e9:.2f} GB/s, plain copy {plain_copy / 1e9:.2f} GB/s "
          f"-> {fraction:.0%} (target >= {TARGET_FRACTION:.0%})")
    if fraction < TARGET_FRACTION:
        failures.append("bandwidth")

    for dtype, n in sizes.matmul_n.items():
        plain = max(reference_loops.plain_matmul_flops(device, n, dtype) for _ in range(3))
        fraction = peaks.matmul_flops_per_s[dtype] / plain
        print(f"matmul {dtype} n={n}: microbench {peaks.matmul_flops_per_s[dtype] / 1e9:.1f} GFLOP/s, "
              f"plain {plain / 1e9:.1f} GFLOP/s -> {fraction:.0%} (target >= {TARGET_FRACTION:.0%})")
        if fraction < TARGET_FRACTION:
            failures.append(f"matmul {dtype}")

    if prof.on_gpu:
        vendor = roofline_devices.match_vendor_spec(torch.cuda.get_device_name(0))
        if vendor is None:
            print(f"no vendor row for {torch.cuda.get_device_name(0)}; skipping spec-sheet fractions")
        else:
            print(f"copy: {peaks.bandwidth_bytes_per_s / 1e12:.2f} TB/s = "
                  f"{peaks.bandwidth_bytes_per_s / vendor.bandwidth_bytes_per_s:.0%} of {vendor.name}'s sheet")
            for dtype, flops in peaks.matmul_flops_per_s.items():
                if dtype in vendor.peak_flops_per_s:
                    print(f"matmul {dtype}: {flops / 1e12:.1f} TFLOP/s = {flops / vendor.peak(dtype):.0%} of the sheet")

    result = overlap.compare(device)
    print(f"overlap: serial {result.serial.total_ms:.1f} ms, overlapped {result.overlapped.total_ms:.1f} ms, "
          f"speedup {result.speedup:.2f}x")
    fused = fusion.compare(device)
    print(f"fusion ({fused.method}): unfused {fused.unfused_ms:.1f} ms, fused {fused.fused_ms:.1f} ms, "
          f"speedup {fused.measured_speedup:.2f}x vs predicted {fused.prediction.byte_ratio:.2f}x "
          f"({'agrees' if fused.agrees else 'DISAGREES'})")
    print(f"load average now {load_average():.2f}; targets missed: {failures or 'none'}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
