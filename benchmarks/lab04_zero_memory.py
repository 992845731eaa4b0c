"""Lab 4 targets: measured per-rank model-state bytes vs labkit.zero, and step time per stage.

Run from the repo root (the active profile sizes the experiment; LABKIT_PROFILE overrides):

    python benchmarks/lab04_zero_memory.py

Prints, per configuration and rank, measured bytes beside the model (target: within 5% at every
stage), the DeepSpeed estimators, each configuration's fastest and median step, and the wall time
of the one launch.
"""

from __future__ import annotations

import time

from labkit import nvme_offload, profile, zero, zero_accounting
from labkit import zero_probe as zp
from labkit.devices import describe_machine

MB = 1e6


def main() -> int:
    prof = profile()
    size = prof.pick(zp.SIZES)
    nvme_ok, nvme_reason = nvme_offload.nvme_available(prof.name)
    configs = list(zp.BASE_CONFIGS + zp.CPU_OFFLOAD_CONFIGS) + ([zp.NVME_CONFIG] if nvme_ok else [])
    print(prof.describe(), describe_machine())
    print(nvme_reason)
    start = time.perf_counter()
    measured = zp.measure(configs, size=size)
    launch_s = time.perf_counter() - start
    n = measured[0].dp_degree
    print(f"{size.num_params:,} params, {size.layers} layers of {size.width}, {n} ranks, "
          f"{measured[0].dtype}; one launch: {launch_s:.1f} s")
    worst = 0.0
    for m in measured:
        if m.config.offloaded:
            model = zero.offload_placement(m.num_params, m.config.stage, n,
                                           optimizer_target=m.config.offload_optimizer,
                                           param_target=m.config.offload_param)
            err = abs(m.on_accelerator.total - model.accelerator.total) / max(model.accelerator.total, 1)
            what = "accelerator side"
        else:
            err = zp.relative_error(m.model_states, zp.predicted(m))
            worst = max(worst, err)
            what = "model states"
        print(f"{m.config.name:34s} rank {m.rank}: measured {m.model_states.total / MB:8.3f} MB "
              f"(acc {m.on_accelerator.total / MB:.3f}, host {m.offloaded.total / MB:.3f}) "
              f"{what} error {err:6.2%}; step best {m.best_step_ms:7.1f} ms, median "
              f"{m.median_step_ms:7.1f} ms; engine init {m.init_ms:.0f} ms")
    print(f"worst stage 0-3 error vs labkit.zero: {worst:.3%} (target < 5%)")
    estimates = zero_accounting.deepspeed_estimates(size.num_params, size.largest_layer_params, n)
    for name, value in estimates.items():
        print(f"DeepSpeed estimator {name}: {value / MB:.3f} MB per rank")
    return 0 if worst < 0.05 else 1


if __name__ == "__main__":
    raise SystemExit(main())
