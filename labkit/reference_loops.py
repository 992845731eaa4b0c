"""Bare loops the microbenchmarks are checked against.

:mod:`labkit.microbench` times every kernel through one harness (warm-up, repeats, the best of them).
A harness can add its own cost, so a test and the Lab 3 benchmark compare its figures with the
plainest loop that does the same work, timed once around the whole loop. ``labkit diagnose`` uses the
same loops for a quick estimate of a machine's ridge.
"""

from __future__ import annotations

import time

import torch

from labkit import roofline
from labkit.devices import synchronize
from labkit.microbench import matmul_precision, square_operands


def plain_matmul_flops(device: torch.device | str, n: int, dtype: str = "float32", *, iterations: int = 10) -> float:
    """The reference the microbenchmark must match: a bare loop of ``a @ b``, one sync at the end."""
    device = torch.device(device)
    a, b = square_operands(device, n, dtype)
    with matmul_precision(roofline.dtype_name(dtype)):
        a @ b
        synchronize(device)
        start = time.perf_counter()
        for _ in range(iterations):
            a @ b
        synchronize(device)
    return 2.0 * n**3 * iterations / (time.perf_counter() - start)


def plain_copy_bytes_per_s(device: torch.device | str, numel: int, *, iterations: int = 10) -> float:
    """The reference for bandwidth: a bare loop of ``dst.copy_(src)``, counting read + write."""
    device = torch.device(device)
    src = torch.ones(numel, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iterations):
        dst.copy_(src)
    synchronize(device)
    return 2 * 4 * numel * iterations / (time.perf_counter() - start)
