"""The roofline: how many FLOPs an op does per byte it moves, and what that allows.

A kernel can go no faster than its arithmetic (``flops / peak_flops_per_s``) nor
faster than its memory traffic (``bytes / bandwidth_bytes_per_s``). Arithmetic
intensity (FLOPs per byte) decides which wall it hits: below the device's ridge
point (peak FLOP/s over bandwidth) the op is memory-bound and a faster chip's
extra FLOP/s buy nothing. Everything here is a pure function of shapes, dtypes
and device figures, so a test can check it and a widget can call it; the devices
themselves (datasheet and measured rows) and the explorer are :mod:`labkit.roofline_devices`.

Byte counts are the minimum traffic to main memory (HBM on a GPU, DRAM on a CPU):
each input read once, each output written once, intermediates of a fused kernel
kept on chip. Real kernels move at least this much.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPE_BYTES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "tf32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8": 1,
}
"""Storage bytes per element. ``tf32`` is fp32 storage computed on tensor cores."""

_DTYPE_ALIASES: dict[str, str] = {
    "fp64": "float64",
    "double": "float64",
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp8": "float8",
    "float8_e4m3fn": "float8",
    "float8_e5m2": "float8",
}


def dtype_name(dtype: str | torch.dtype) -> str:
    """Canonical name of a supported dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    elif isinstance(dtype, str):
        name = dtype.lower().removeprefix("torch.")
    else:
        raise ValueError(f"dtype must be a str or torch.dtype, got {type(dtype).__name__}")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)} (or an alias), got {dtype!r}")
    return name


def dtype_bytes(dtype: str | torch.dtype) -> int:
    return DTYPE_BYTES[dtype_name(dtype)]


def _positive(**dims: int) -> None:
    for name, value in dims.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class OpCost:
    """FLOPs done and bytes moved by one op; intensity is their ratio."""

    name: str
    flops: float
    bytes_moved: float
    dtype: str

    @property
    def intensity(self) -> float:
        """FLOPs per byte of memory traffic."""
        return self.flops / self.bytes_moved


def elementwise(
    numel: int,
    dtype: str | torch.dtype = "float32",
    *,
    inputs: int = 1,
    outputs: int = 1,
    flops_per_element: int = 1,
    name: str = "elementwise",
) -> OpCost:
    """An op that touches every element once: add, GELU, scale, residual add, cast."""
    _positive(numel=numel, inputs=inputs, outputs=outputs, flops_per_element=flops_per_element)
    size = dtype_bytes(dtype)
    return OpCost(name, numel * flops_per_element, (inputs + outputs) * numel * size, dtype_name(dtype))


def copy(numel: int, dtype: str | torch.dtype = "float32") -> OpCost:
    """A copy does no arithmetic; it counts as one FLOP per element only to stay on a log plot."""
    return elementwise(numel, dtype, flops_per_element=1, name="copy")


def reduction(rows: int, cols: int, dtype: str | torch.dtype = "float32") -> OpCost:
    """Sum of each row: every input read once, one value per row written."""
    _positive(rows=rows, cols=cols)
    size = dtype_bytes(dtype)
    return OpCost("reduction", rows * cols, (rows * cols + rows) * size, dtype_name(dtype))


def softmax(rows: int, cols: int, dtype: str | torch.dtype = "float32") -> OpCost:
    """Row softmax: max, subtract, exp, sum, divide, about 5 FLOPs per element, one pass."""
    _positive(rows=rows, cols=cols)
    size = dtype_bytes(dtype)
    return OpCost("softmax", 5 * rows * cols, 2 * rows * cols * size, dtype_name(dtype))


def layer_norm(rows: int, hidden: int, dtype: str | torch.dtype = "float32") -> OpCost:
    """LayerNorm with weight and bias: mean, variance, normalise, scale, shift (~8 FLOPs/element)."""
    _positive(rows=rows, hidden=hidden)
    size = dtype_bytes(dtype)
    return OpCost("layer_norm", 8 * rows * hidden, (2 * rows * hidden + 2 * hidden) * size, dtype_name(dtype))


def matmul(m: int, n: int, k: int, dtype: str | torch.dtype = "float32", *, batch: int = 1) -> OpCost:
    """``(m x k) @ (k x n)``: 2mnk FLOPs; reads both operands and writes the result once."""
    _positive(m=m, n=n, k=k, batch=batch)
    size = dtype_bytes(dtype)
    return OpCost(
        f"matmul {m}x{k}x{n}",
        2.0 * batch * m * n * k,
        float(batch * (m * k + k * n + m * n) * size),
        dtype_name(dtype),
    )


def square_matmul_intensity(n: int, dtype: str | torch.dtype = "float32") -> float:
    """For ``n x n`` matrices intensity is ``2n^3 / (3 n^2 bytes)``: it grows linearly with n."""
    return matmul(n, n, n, dtype).intensity


def ridge_point(peak_flops_per_s: float, bandwidth_bytes_per_s: float) -> float:
    """FLOPs per byte an op needs before compute, not memory, limits it."""
    if peak_flops_per_s <= 0 or bandwidth_bytes_per_s <= 0:
        raise ValueError(
            f"peak_flops_per_s and bandwidth_bytes_per_s must be > 0, "
            f"got {peak_flops_per_s}, {bandwidth_bytes_per_s}"
        )
    return peak_flops_per_s / bandwidth_bytes_per_s


def attainable_flops_per_s(intensity: float, peak_flops_per_s: float, bandwidth_bytes_per_s: float) -> float:
    """The roofline itself: ``min(peak, intensity x bandwidth)``."""
    if intensity <= 0:
        raise ValueError(f"intensity must be > 0 FLOP/byte, got {intensity}")
    ridge_point(peak_flops_per_s, bandwidth_bytes_per_s)
    return min(peak_flops_per_s, intensity * bandwidth_bytes_per_s)


def min_time_s(cost: OpCost, peak_flops_per_s: float, bandwidth_bytes_per_s: float) -> float:
    """Lower bound on run time: the slower of doing the FLOPs and moving the bytes."""
    ridge_point(peak_flops_per_s, bandwidth_bytes_per_s)
    return max(cost.flops / peak_flops_per_s, cost.bytes_moved / bandwidth_bytes_per_s)
