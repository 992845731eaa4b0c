"""A one-minute machine card: the rates every lab's bottleneck depends on.

Before choosing which lab matters for a run, measure the handful of rates that
bound a training step here: how fast the accelerator multiplies and moves memory
(Lab 3), how fast data crosses from host to device, how fast ranks exchange
gradients (Lab 5), how fast storage absorbs a checkpoint (Lab 7) and how fast the
host decodes images (Lab 1). :func:`bottlenecks` turns them into a rough time per
step for a model size and batch, so the slowest component points to a lab.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from labkit.devices import Stopwatch, describe_machine, loader_workers, pick_device
from labkit.paths import data_dir


@dataclass(frozen=True)
class MachineCard:
    device: str
    matmul_flops_per_s: float
    memory_bytes_per_s: float
    host_to_device_bytes_per_s: float | None
    allreduce_busbw_bytes_per_s: float
    storage_write_bytes_per_s: float
    decode_images_per_s: float
    machine: dict


@dataclass(frozen=True)
class StepEstimate:
    component: str
    seconds: float
    lab: int


def measure_card(*, quick: bool = True) -> MachineCard:
    """Measure every rate once; ``quick`` keeps the whole card under a minute on a 2-core box."""
    from labkit import collective_bench, microbench

    device = pick_device()
    scale = 1 if quick else 4
    flops = microbench.measure_matmul_flops(device, 512 * scale if device.type == "cpu" else 8192, "float32")
    bandwidth = microbench.measure_bandwidth(device, 4_000_000 * scale if device.type == "cpu" else 100_000_000)
    rows = collective_bench.run_benchmark(2, message_bytes=[16 * 2**20], ops=("all_reduce",), repeats=5)
    busbw = rows[0]["busbw_gbytes_per_s"] * 1e9
    return MachineCard(
        device=str(device),
        matmul_flops_per_s=flops,
        memory_bytes_per_s=bandwidth.peak_bytes_per_s,
        host_to_device_bytes_per_s=host_to_device_bytes_per_s(device),
        allreduce_busbw_bytes_per_s=busbw,
        storage_write_bytes_per_s=storage_write_bytes_per_s(data_dir(), 64 * 2**20 * scale),
        decode_images_per_s=decode_images_per_s(),
        machine=describe_machine(),
    )


def host_to_device_bytes_per_s(device: torch.device, numel: int = 64 * 2**20) -> float | None:
    """Pinned host -> device copy rate; None on the CPU, where there is no copy to make."""
    if device.type != "cuda":
        return None
    host = torch.empty(numel, dtype=torch.uint8).pin_memory()
    target = torch.empty(numel, dtype=torch.uint8, device=device)
    target.copy_(host, non_blocking=True)
    with Stopwatch(device) as sw:
        for _ in range(5):
            target.copy_(host, non_blocking=True)
    return 5 * numel / (sw.ms / 1e3)


def storage_write_bytes_per_s(folder: Path, nbytes: int) -> float:
    """Write and fsync ``nbytes`` (a checkpoint-sized write lands on disk, not in the page cache)."""
    if nbytes < 1:
        raise ValueError(f"nbytes must be >= 1, got {nbytes}")
    payload = os.urandom(min(nbytes, 2**20))
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".card-") as handle:
        start = time.perf_counter()
        written = 0
        while written < nbytes:
            handle.write(payload)
            written += len(payload)
        handle.flush()
        os.fsync(handle.fileno())
        return written / (time.perf_counter() - start)


def decode_images_per_s(count: int = 200) -> float:
    """JPEG decode + resize to 32 px per second on one core, for a dataset-like image."""
    from labkit.dataset import encode_jpeg, render_image
    from labkit.loaders import decode

    data = encode_jpeg(render_image(np.random.default_rng(0), 0))
    start = time.perf_counter()
    for _ in range(count):
        decode(data, 32)
    return count / (time.perf_counter() - start)


def bottlenecks(card: MachineCard, *, num_params: int, batch_size: int, ranks: int = 2,
                loader_cores: int | None = None, checkpoint_every_steps: int = 100) -> list[StepEstimate]:
    """Rough seconds per step for each component, slowest first.

    Compute: 6 FLOPs per parameter per sample (forward + backward of a dense
    model). Gradient sync: a ring all-reduce of bf16 gradients. Input: decoding
    ``batch_size`` images on the loader's cores. Checkpoint: 16 bytes per parameter
    (ZeRO's mixed-precision Adam state) written every ``checkpoint_every_steps``.
    """
    if num_params < 1 or batch_size < 1 or ranks < 1 or checkpoint_every_steps < 1:
        raise ValueError("num_params, batch_size, ranks and checkpoint_every_steps must all be >= 1")
    cores = loader_cores or loader_workers()
    sync = 0.0 if ranks == 1 else 2 * num_params / card.allreduce_busbw_bytes_per_s
    estimates = [
        StepEstimate("compute (Lab 3)", 6 * num_params * batch_size / card.matmul_flops_per_s, 3),
        StepEstimate("gradient sync (Lab 5)", sync, 5),
        StepEstimate("input decode (Lab 1)", batch_size / (card.decode_images_per_s * cores), 1),
        StepEstimate("checkpoint, amortised (Lab 7)",
                     16 * num_params / card.storage_write_bytes_per_s / checkpoint_every_steps, 7),
    ]
    return sorted(estimates, key=lambda e: e.seconds, reverse=True)


def format_card(card: MachineCard) -> str:
    h2d = "n/a (host and device share memory)" if card.host_to_device_bytes_per_s is None \
        else f"{card.host_to_device_bytes_per_s / 1e9:.1f} GB/s"
    return "\n".join([
        f"machine: {card.machine}",
        f"matmul (fp32)          {card.matmul_flops_per_s / 1e12:8.3f} TFLOP/s   (Lab 3)",
        f"memory bandwidth       {card.memory_bytes_per_s / 1e9:8.1f} GB/s      (Lab 3)",
        f"host -> device         {h2d}",
        f"all-reduce busbw, 2 rk {card.allreduce_busbw_bytes_per_s / 1e9:8.2f} GB/s      (Lab 5)",
        f"storage write + fsync  {card.storage_write_bytes_per_s / 1e9:8.2f} GB/s      (Lab 7)",
        f"JPEG decode, 1 core    {card.decode_images_per_s:8.0f} images/s  (Lab 1)",
    ])
