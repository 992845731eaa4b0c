"""Devices on the roofline: their peak figures, and where a layer's ops land under them.

:mod:`labkit.roofline` is the model (FLOPs and bytes per op, ridge point,
attainable FLOP/s); this module holds the devices it is applied to: vendor
datasheet rows (quoted, not measured), an estimate for the host CPU, rows built
from this machine's microbenchmarks, and the explorer and plot Lab 3 draws with them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping

import torch

from labkit.roofline import (OpCost, attainable_flops_per_s, dtype_name, elementwise, layer_norm, matmul, min_time_s, ridge_point, softmax, _positive)


@dataclass(frozen=True)
class DeviceSpec:
    """Peak dense FLOP/s per dtype and memory bandwidth of one device, with where they come from."""

    name: str
    peak_flops_per_s: Mapping[str, float]
    bandwidth_bytes_per_s: float
    source: str
    notes: str = ""

    def peak(self, dtype: str | torch.dtype) -> float:
        name = dtype_name(dtype)
        if name not in self.peak_flops_per_s:
            raise ValueError(
                f"dtype {name!r} has no peak figure for {self.name}; it has {sorted(self.peak_flops_per_s)}"
            )
        return self.peak_flops_per_s[name]

    def ridge(self, dtype: str | torch.dtype) -> float:
        return ridge_point(self.peak(dtype), self.bandwidth_bytes_per_s)

    def attainable(self, cost: OpCost) -> float:
        return attainable_flops_per_s(cost.intensity, self.peak(cost.dtype), self.bandwidth_bytes_per_s)


TERA = 1e12

# H100 SXM and H200 SXM share the compute die: one table of dense tensor-core FLOP/s.
_HOPPER_SXM_FLOPS = {"float64": 34 * TERA, "float32": 67 * TERA, "tf32": 494.7 * TERA, "bfloat16": 989.4 * TERA,
                     "float16": 989.4 * TERA, "float8": 1978.9 * TERA}

VENDOR_SPECS: dict[str, DeviceSpec] = {
    "A100": DeviceSpec(
        "A100",
        {"float64": 9.7 * TERA, "float32": 19.5 * TERA, "tf32": 156 * TERA, "bfloat16": 312 * TERA,
         "float16": 312 * TERA},
        2.039 * TERA,
        "vendor figure: NVIDIA A100 80GB SXM datasheet (dense tensor-core FLOP/s, HBM2e)",
    ),
    "H100": DeviceSpec(
        "H100",
        _HOPPER_SXM_FLOPS,
        3.35 * TERA,
        "vendor figure: NVIDIA H100 SXM datasheet (dense; the sheet's headline doubles these with sparsity)",
    ),
    "H200": DeviceSpec(
        "H200",
        _HOPPER_SXM_FLOPS,
        4.8 * TERA,
        "vendor figure: NVIDIA H200 SXM datasheet (H100's compute, HBM3e at 4.8 TB/s; dense)",
    ),
    "B200": DeviceSpec(
        "B200",
        {"float64": 40 * TERA, "float32": 80 * TERA, "tf32": 1100 * TERA, "bfloat16": 2250 * TERA,
         "float16": 2250 * TERA, "float8": 4500 * TERA},
        8.0 * TERA,
        "vendor figure: NVIDIA HGX B200 (1000 W) per-GPU figures, dense",
    ),
}
"""Vendor datasheet figures, quoted as the vendors' (not measured here)."""


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cpu_ghz() -> float:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("cpu MHz"):
                    return float(line.split(":", 1)[1]) / 1e3
    except (OSError, ValueError):
        pass
    return 2.5


def fp32_flops_per_cycle(flags: Iterable[str]) -> int:
    """Per-core fp32 FLOPs per cycle from the vector ISA, assuming two FMA units (an upper bound)."""
    flags = set(flags)
    if "avx512f" in flags:
        return 64
    if "avx2" in flags and "fma" in flags:
        return 32
    if "avx" in flags:
        return 16
    return 8


def host_cpu_spec(bandwidth_bytes_per_s: float, *, cores: int | None = None, ghz: float | None = None,
                  flags: Iterable[str] | None = None) -> DeviceSpec:
    """The CPU these labs run on: peak estimated from cores x clock x ISA, bandwidth as measured.

    A virtual machine's share of a socket has no datasheet, so this row is an
    estimate, labelled as one; it is not a vendor figure.
    """
    if bandwidth_bytes_per_s <= 0:
        raise ValueError(f"bandwidth_bytes_per_s must be > 0, got {bandwidth_bytes_per_s}")
    cores = cores or len(os.sched_getaffinity(0))
    ghz = ghz or _cpu_ghz()
    flags = set(_cpu_flags() if flags is None else flags)
    fp32 = cores * ghz * 1e9 * fp32_flops_per_cycle(flags)
    peaks = {"float32": fp32, "float64": fp32 / 2}
    if "avx512_bf16" in flags or "amx_bf16" in flags:
        peaks["bfloat16"] = 2 * fp32
    return DeviceSpec(
        "host CPU",
        peaks,
        bandwidth_bytes_per_s,
        f"estimate, not a vendor figure: {cores} cores x {ghz:.2f} GHz x "
        f"{fp32_flops_per_cycle(flags)} fp32 FLOP/cycle; bandwidth measured here",
    )


def spec_table(host: DeviceSpec | None = None) -> dict[str, DeviceSpec]:
    """The vendor rows, plus the host CPU's row when given."""
    table = dict(VENDOR_SPECS)
    if host is not None:
        table[host.name] = host
    return table


def device_spec(name: str, table: Mapping[str, DeviceSpec] | None = None) -> DeviceSpec:
    """Look a device up by name (case-insensitive), or say which names exist."""
    table = VENDOR_SPECS if table is None else table
    for key, spec in table.items():
        if key.lower() == str(name).strip().lower():
            return spec
    raise ValueError(f"device must be one of {sorted(table)}, got {name!r}")


VENDOR_DEVICE_NAMES: dict[str, str] = {
    "NVIDIA A100-SXM4-80GB": "A100",
    "NVIDIA H100 80GB HBM3": "H100",
    "NVIDIA H200": "H200",
    "NVIDIA B200": "B200",
}
"""CUDA device names (``torch.cuda.get_device_name``) of exactly the variants each vendor row quotes.

A family name is not enough: an "NVIDIA H100 PCIe" has fewer SMs, lower clocks and
2 TB/s instead of the SXM's 3.35; an "NVIDIA H200 NVL" and an "NVIDIA A100 80GB PCIe"
differ from their SXM rows too. Those (and any name not listed) get no vendor row,
and the lab falls back to the roof it measured."""


def match_vendor_spec(gpu_name: str) -> DeviceSpec | None:
    """The vendor row for a CUDA device name such as ``"NVIDIA H100 80GB HBM3"``, or None.

    Only the exact variants in :data:`VENDOR_DEVICE_NAMES` match; another variant of
    the same family (PCIe, NVL, 40 GB) returns None rather than another part's figures.
    """
    wanted = " ".join(gpu_name.split()).lower()
    for device_name, key in VENDOR_DEVICE_NAMES.items():
        if device_name.lower() == wanted:
            return VENDOR_SPECS[key]
    return None


def measured_spec(name: str, peak_flops_per_s: Mapping[str, float], bandwidth_bytes_per_s: float) -> DeviceSpec:
    """A row built from this device's microbenchmarks: the roof it really has."""
    return DeviceSpec(name, dict(peak_flops_per_s), bandwidth_bytes_per_s, "measured here by labkit.microbench")


@dataclass(frozen=True)
class Placement:
    """Where one op lands on one device's roofline."""

    device: str
    cost: OpCost
    ridge: float
    attainable_flops_per_s: float
    min_time_ms: float
    bound: str
    fraction_of_peak: float
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return (
            f"{self.cost.name} ({self.cost.dtype}) on {self.device}: "
            f"{self.cost.intensity:.1f} FLOP/byte vs ridge {self.ridge:.1f} -> {self.bound}; "
            f"at best {self.attainable_flops_per_s / TERA:.3g} TFLOP/s "
            f"({self.fraction_of_peak:.1%} of peak), >= {self.min_time_ms:.3g} ms"
        )


def place(cost: OpCost, spec: DeviceSpec) -> Placement:
    """Put an op on a device's roofline: memory- or compute-bound, and how fast at best."""
    ridge = spec.ridge(cost.dtype)
    attainable = spec.attainable(cost)
    return Placement(
        device=spec.name,
        cost=cost,
        ridge=ridge,
        attainable_flops_per_s=attainable,
        min_time_ms=min_time_s(cost, spec.peak(cost.dtype), spec.bandwidth_bytes_per_s) * 1e3,
        bound="memory-bound" if cost.intensity < ridge else "compute-bound",
        fraction_of_peak=attainable / spec.peak(cost.dtype),
    )


def explore(
    device: str,
    *,
    batch: int,
    seq_len: int,
    hidden: int,
    dtype: str | torch.dtype = "bfloat16",
    table: Mapping[str, DeviceSpec] | None = None,
) -> dict[str, Placement]:
    """The explorer's logic: a transformer layer's main ops at this shape, placed on ``device``.

    Tokens are ``batch x seq_len``; the MLP's first projection is a
    ``tokens x hidden @ hidden x 4 hidden`` matmul; attention scores are
    softmaxed over ``seq_len``; LayerNorm and the residual add are elementwise-like.
    """
    _positive(batch=batch, seq_len=seq_len, hidden=hidden)
    spec = device_spec(device, table)
    tokens = batch * seq_len
    costs = [
        replace(matmul(tokens, 4 * hidden, hidden, dtype), name="MLP matmul"),
        replace(softmax(batch * seq_len, seq_len, dtype), name="attention softmax"),
        layer_norm(tokens, hidden, dtype),
        elementwise(tokens * hidden, dtype, inputs=2, name="residual add"),
    ]
    return {cost.name: place(cost, spec) for cost in costs}


def explorer_text(device: str, batch: int, seq_len: int, hidden: int, dtype: str = "bfloat16",
                  table: Mapping[str, DeviceSpec] | None = None) -> str:
    """What the widget prints: one line per op."""
    return "\n".join(p.describe() for p in explore(
        device, batch=batch, seq_len=seq_len, hidden=hidden, dtype=dtype, table=table).values())


def explorer_widget(table: Mapping[str, DeviceSpec] | None = None):
    """Controls over :func:`explore`: pick a device and a shape, read the verdict (see :mod:`labkit.widgets`)."""
    import ipywidgets as widgets

    from labkit.widgets import live

    table = dict(VENDOR_SPECS if table is None else table)
    dtypes = sorted({d for spec in table.values() for d in spec.peak_flops_per_s})
    controls = {
        "device": widgets.Dropdown(options=list(table), value=next(iter(table)), description="device"),
        "dtype": widgets.Dropdown(options=dtypes, value="bfloat16" if "bfloat16" in dtypes else dtypes[0],
                                  description="dtype"),
        "batch": widgets.IntSlider(value=1, min=1, max=64, description="batch"),
        "seq_len": widgets.IntSlider(value=128, min=1, max=8192, step=1, description="seq_len"),
        "hidden": widgets.IntSlider(value=4096, min=64, max=16384, step=64, description="hidden"),
    }

    def render(device: str, dtype: str, batch: int, seq_len: int, hidden: int) -> str:
        try:
            return explorer_text(device, batch, seq_len, hidden, dtype, table)
        except ValueError as err:
            return f"not available: {err}"

    return live(render, controls, rows=[["device", "dtype"], ["batch"], ["seq_len"], ["hidden"]])


def plot_roofline(ax, roofs: Mapping[str, tuple[float, float]], points: Iterable[tuple[str, float, float]] = (),
                  *, intensity_range: tuple[float, float] = (1 / 16, 4096)) -> None:
    """Draw roofs ``{label: (peak_flops_per_s, bandwidth_bytes_per_s)}`` and measured points
    ``(label, intensity, achieved_flops_per_s)`` on log-log axes."""
    import numpy as np

    from labkit.plots import PALETTE

    xs = np.geomspace(*intensity_range, 200)
    for i, (label, (peak, bandwidth)) in enumerate(roofs.items()):
        style = "-" if "measured" in label else "--"
        ax.plot(xs, np.minimum(peak, xs * bandwidth), style, color=PALETTE[i % len(PALETTE)], label=label)
    for label, intensity, achieved in points:
        ax.scatter([intensity], [achieved], zorder=3, s=22, color="black")
        ax.annotate(label, (intensity, achieved), fontsize=7, xytext=(4, -8), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("FLOP/s")
    ax.legend(loc="lower right", fontsize=7)
