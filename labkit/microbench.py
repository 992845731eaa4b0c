"""Measure this device's roofs and where real ops land under them.

Datasheet peaks are upper bounds nobody reaches; the roof that matters is the one
*this* machine delivers. Peak bandwidth is the best of the four STREAM kernels
(copy, scale, add, triad) on arrays far larger than the last-level cache; peak
compute is a large square matmul per dtype. Ops are then timed and their
achieved FLOP/s and bytes/s computed from the cost model in
:mod:`labkit.roofline`, so every point on the plot is a measurement divided by a
prediction.

Times are the *minimum* over repeats: noise on a shared machine only ever adds
time, so the fastest run is the best estimate of what the hardware can do.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from tqdm.auto import tqdm

from labkit import roofline, roofline_devices
from labkit.devices import time_ms
from labkit.profiles import profile, require_at_least

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "tf32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

MEASUREMENT_TOLERANCE = 0.10
"""Two timings of the same traffic differ by run-to-run noise; no op beats the roof by more than this."""


@dataclass(frozen=True)
class MicrobenchSizes:
    bandwidth_numel: int
    matmul_n: dict[str, int]
    op_numel_rows: int
    op_numel_cols: int
    matmul_sweep: tuple[int, ...]
    op_dtype: str
    repeats: int
    intensity_elements: int = 8 * 2**20
    intensity_widths: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

    def __post_init__(self) -> None:
        require_at_least(self, 1, "bandwidth_numel", "op_numel_rows", "op_numel_cols", "repeats", "intensity_elements")
        if min(self.matmul_sweep, default=0) < 1 or min(self.matmul_n.values(), default=0) < 1:
            raise ValueError("MicrobenchSizes.matmul_sweep and matmul_n must hold sizes >= 1, "
                             f"got {self.matmul_sweep} and {self.matmul_n}")


SIZES = {
    "ci": MicrobenchSizes(
        bandwidth_numel=32 * 2**20,
        matmul_n={"float32": 1024, "float64": 768, "bfloat16": 256},
        op_numel_rows=4096,
        op_numel_cols=4096,
        matmul_sweep=(16, 64, 256, 1024),
        op_dtype="float32",
        repeats=5,
    ),
    "gpu": MicrobenchSizes(
        bandwidth_numel=256 * 2**20,
        matmul_n={"float32": 8192, "tf32": 8192, "bfloat16": 8192, "float16": 8192},
        op_numel_rows=16384,
        op_numel_cols=8192,
        matmul_sweep=(64, 256, 1024, 4096, 8192),
        op_dtype="bfloat16",
        repeats=20,
        intensity_elements=64 * 2**20,
        intensity_widths=(1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096),
    ),
}
SIZES["multi-gpu"] = SIZES["gpu"]


def sizes() -> MicrobenchSizes:
    return profile().pick(SIZES)


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    name = roofline.dtype_name(dtype)
    if name not in TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(TORCH_DTYPES)} to measure here, got {dtype!r}")
    return TORCH_DTYPES[name]


@contextlib.contextmanager
def matmul_precision(dtype: str) -> Iterator[None]:
    """``tf32`` means fp32 tensors on tensor cores: switch it on only for that measurement."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


ROOF_TILE = 256
"""Square roof matmuls are sized in multiples of this (see :func:`square_size_for`)."""


def best_ms(fn: Callable[[], object], device: torch.device | str, *, warmup: int = 1, repeats: int = 5) -> float:
    return min(time_ms(fn, device=device, warmup=warmup, repeats=repeats))


@dataclass(frozen=True)
class BandwidthResult:
    """Best bytes/s of each STREAM kernel; the device's peak is the best of them."""

    by_kernel_bytes_per_s: dict[str, float]
    numel: int
    dtype: str

    @property
    def peak_bytes_per_s(self) -> float:
        return max(self.by_kernel_bytes_per_s.values())


def measure_bandwidth(device: torch.device | str, numel: int, dtype: str = "float32",
                      *, repeats: int = 5) -> BandwidthResult:
    """STREAM copy / scale / add / triad on three arrays of ``numel`` elements (size them >> cache)."""
    roofline.elementwise(numel, dtype)
    tdtype = torch_dtype(dtype)
    device = torch.device(device)
    a, b, c = (torch.ones(numel, dtype=tdtype, device=device) for _ in range(3))
    size = roofline.dtype_bytes(dtype)
    kernels: dict[str, tuple[Callable[[], object], int]] = {
        "copy": (lambda: b.copy_(a), 2),
        "scale": (lambda: torch.mul(a, 3.0, out=b), 2),
        "add": (lambda: torch.add(a, b, out=c), 3),
        "triad": (lambda: torch.add(b, c, alpha=3.0, out=a), 3),
    }
    result = {}
    for name, (fn, arrays) in kernels.items():
        result[name] = arrays * numel * size / (best_ms(fn, device, repeats=repeats) / 1e3)
    return BandwidthResult(result, numel, roofline.dtype_name(dtype))


def measure_matmul_flops(device: torch.device | str, n: int, dtype: str = "float32", *, repeats: int = 5) -> float:
    """Best FLOP/s of square matmuls of size ``n/2`` and ``n``: the compute roof for ``dtype``.

    Two sizes because the fastest size depends on the caches and the library's
    blocking; the roof is the best any of them reached.
    """
    roofline.matmul(n, n, n, dtype)
    return max(square_matmul_flops(device, size, dtype, repeats=repeats) for size in sorted({max(1, n // 2), n}))


def square_matmul_flops(device: torch.device | str, n: int, dtype: str = "float32", *, repeats: int = 5) -> float:
    """Best FLOP/s of one ``n x n @ n x n`` matmul."""
    device = torch.device(device)
    tdtype = torch_dtype(dtype)
    a = torch.randn(n, n, device=device).to(tdtype)
    b = torch.randn(n, n, device=device).to(tdtype)
    with matmul_precision(roofline.dtype_name(dtype)):
        ms = best_ms(lambda: a @ b, device, warmup=2, repeats=repeats)
    return roofline.matmul(n, n, n, dtype).flops / (ms / 1e3)


@dataclass(frozen=True)
class DevicePeaks:
    """This device's measured roofs."""

    device: str
    bandwidth: BandwidthResult
    matmul_flops_per_s: dict[str, float]

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.bandwidth.peak_bytes_per_s

    def ridge(self, dtype: str) -> float:
        return roofline.ridge_point(self.matmul_flops_per_s[roofline.dtype_name(dtype)], self.bandwidth_bytes_per_s)

    def as_spec(self, name: str = "this device (measured)") -> roofline_devices.DeviceSpec:
        return roofline_devices.measured_spec(name, self.matmul_flops_per_s, self.bandwidth_bytes_per_s)


def measure_peaks(device: torch.device | str | None = None, chosen: MicrobenchSizes | None = None) -> DevicePeaks:
    """Peak bandwidth and peak matmul FLOP/s per dtype, with a progress bar."""
    chosen = chosen or sizes()
    device = torch.device(device or profile().device)
    steps = tqdm(["bandwidth", *chosen.matmul_n], desc="measuring peaks", leave=False)
    bandwidth = None
    flops: dict[str, float] = {}
    for step in steps:
        if step == "bandwidth":
            bandwidth = measure_bandwidth(device, chosen.bandwidth_numel, repeats=chosen.repeats)
        else:
            flops[step] = measure_matmul_flops(device, chosen.matmul_n[step], step, repeats=chosen.repeats)
    assert bandwidth is not None
    return DevicePeaks(str(device), bandwidth, flops)


@dataclass(frozen=True)
class OpMeasurement:
    """One op timed: the model's FLOPs and bytes over the measured time."""

    cost: roofline.OpCost
    ms: float

    @property
    def flops_per_s(self) -> float:
        return self.cost.flops / (self.ms / 1e3)

    @property
    def bytes_per_s(self) -> float:
        return self.cost.bytes_moved / (self.ms / 1e3)

    def as_row(self) -> dict[str, object]:
        return {
            "op": self.cost.name,
            "FLOP/byte": round(self.cost.intensity, 2),
            "ms": round(self.ms, 3),
            "GFLOP/s": round(self.flops_per_s / 1e9, 2),
            "GB/s": round(self.bytes_per_s / 1e9, 2),
        }


def measure_op(cost: roofline.OpCost, fn: Callable[[], object], device: torch.device | str,
               *, repeats: int = 5) -> OpMeasurement:
    return OpMeasurement(cost, best_ms(fn, device, repeats=repeats))


@dataclass
class OpSuite:
    """The ops a transformer step is made of, at one size, ready to time."""

    device: torch.device
    dtype: str
    ops: list[tuple[roofline.OpCost, Callable[[], object]]] = field(default_factory=list)


def transformer_ops(device: torch.device | str, chosen: MicrobenchSizes) -> OpSuite:
    """Residual add, ReLU, softmax, LayerNorm at ``rows x cols``, and a sweep of square matmuls."""
    device = torch.device(device)
    dtype = roofline.dtype_name(chosen.op_dtype)
    tdtype = torch_dtype(dtype)
    rows, cols = chosen.op_numel_rows, chosen.op_numel_cols
    x = torch.randn(rows, cols, device=device).to(tdtype)
    y = torch.randn(rows, cols, device=device).to(tdtype)
    norm = torch.nn.LayerNorm(cols, device=device, dtype=tdtype)
    suite = OpSuite(device, dtype)
    suite.ops += [
        (roofline.elementwise(rows * cols, dtype, inputs=2, name="residual add"), lambda: x + y),
        (roofline.elementwise(rows * cols, dtype, name="relu"), lambda: torch.relu(x)),
        (roofline.softmax(rows, cols, dtype), lambda: torch.softmax(x, dim=-1)),
        (roofline.layer_norm(rows, cols, dtype), lambda: norm(x)),
    ]
    for n in chosen.matmul_sweep:
        a = torch.randn(n, n, device=device).to(tdtype)
        b = torch.randn(n, n, device=device).to(tdtype)
        suite.ops.append((roofline.matmul(n, n, n, dtype), lambda a=a, b=b: a @ b))
    return suite


def measure_ops(device: torch.device | str | None = None, chosen: MicrobenchSizes | None = None) -> list[OpMeasurement]:
    chosen = chosen or sizes()
    device = torch.device(device or profile().device)
    suite = transformer_ops(device, chosen)
    with torch.inference_mode():
        return [measure_op(cost, fn, device, repeats=chosen.repeats)
                for cost, fn in tqdm(suite.ops, desc="timing ops", leave=False)]


def memory_bound_ops(measurements: list[OpMeasurement], ridge: float) -> list[OpMeasurement]:
    """The measured ops whose intensity is below ``ridge``: their speed is their bandwidth."""
    return [m for m in measurements if m.cost.intensity < ridge]


def plain_matmul_flops(device: torch.device | str, n: int, dtype: str = "float32", *, iterations: int = 10) -> float:
    """The reference the microbenchmark must match: a bare loop of ``a @ b``, one sync at the end."""
    import time

    from labkit.devices import synchronize

    device = torch.device(device)
    tdtype = torch_dtype(dtype)
    a = torch.randn(n, n, device=device).to(tdtype)
    b = torch.randn(n, n, device=device).to(tdtype)
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
    import time

    from labkit.devices import synchronize

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


@dataclass(frozen=True)
class IntensitySweep:
    """One kind of op at rising intensity, measured: does it climb the memory roof and flatten at compute?"""

    points: list[OpMeasurement]
    peak_flops_per_s: float
    bandwidth_bytes_per_s: float

    @property
    def ridge(self) -> float:
        return roofline.ridge_point(self.peak_flops_per_s, self.bandwidth_bytes_per_s)

    def crossover_intensity(self, share: float = 0.5) -> float:
        """The lowest swept intensity whose achieved FLOP/s reaches ``share`` of the measured compute peak.

        On the roofline an op reaches half the peak at half the ridge; a real
        kernel gets there later, so this is where the climb measurably turns into
        the flat part. ``inf`` if no point got there.
        """
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share}")
        reached = [p.cost.intensity for p in self.points if p.flops_per_s >= share * self.peak_flops_per_s]
        return min(reached, default=float("inf"))

    def climb(self) -> float:
        """Achieved FLOP/s of the most intense point over the least intense one."""
        return self.points[-1].flops_per_s / self.points[0].flops_per_s

    def over_memory_roof(self) -> list[OpMeasurement]:
        """Points below the ridge that beat intensity x bandwidth by more than the noise: a wrong byte count."""
        return [p for p in self.points if p.cost.intensity < self.ridge
                and p.flops_per_s > p.cost.intensity * self.bandwidth_bytes_per_s * (1 + MEASUREMENT_TOLERANCE)]


def intensity_sweep(device: torch.device | str, dtype: str | None = None,
                    chosen: MicrobenchSizes | None = None, *, rounds: int = 3) -> IntensitySweep:
    """``x [M, K] @ w [K, K]`` for rising K, with ``M * K`` fixed.

    Every call moves about the same bytes (x in, the result out) while its FLOPs
    grow with K, so intensity is about K / (2 x element size): a knob from far
    below the ridge to far above it, with one kernel per call. Memory-bound
    points should climb with intensity and compute-bound ones flatten at the
    compute roof. A real kernel turns later than the roofline's corner: how
    much later is what this measures.

    The two roofs are measured here, taking turns with the points round by round,
    and each item keeps its best round. Roofs timed a minute earlier on a shared
    machine can be ones no point of a busier minute reaches: a CI run found no
    point at half a compute roof measured before the sweep. The compute roof is a
    square matmul doing as many FLOPs as the widest point: beside a busy process,
    the best of a few short matmuls lands in a quiet slice that long ones never
    get (beside a busy process on 2 cores, 512 x 512 matmuls reached 184-202
    GFLOP/s, 2048 x 2048 ones 90-93, the widest point 86-94).
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    chosen = chosen or sizes()
    dtype = roofline.dtype_name(dtype or chosen.op_dtype)
    device = torch.device(device)
    roof_n = square_size_for(_skinny_matmul_cost(chosen, max(chosen.intensity_widths), dtype).flops)
    best_point_ms = [float("inf")] * len(chosen.intensity_widths)
    compute_roof = bandwidth = 0.0
    steps = tqdm(total=rounds * (len(chosen.intensity_widths) + 1), desc="intensity sweep", leave=False)
    with steps:
        for _ in range(rounds):
            compute_roof = max(compute_roof, square_matmul_flops(device, roof_n, dtype, repeats=chosen.repeats))
            bandwidth = max(bandwidth, measure_bandwidth(device, chosen.bandwidth_numel,
                                                         repeats=chosen.repeats).peak_bytes_per_s)
            steps.update()
            for i, width in enumerate(chosen.intensity_widths):
                best_point_ms[i] = min(best_point_ms[i], _time_skinny_matmul(device, chosen, width, dtype))
                steps.update()
    points = [OpMeasurement(_skinny_matmul_cost(chosen, width, dtype), ms)
              for width, ms in zip(chosen.intensity_widths, best_point_ms)]
    # The compute roof is the best FLOP/s any measurement reached (as in measure_matmul_flops).
    peak = max(compute_roof, *(p.flops_per_s for p in points))
    return IntensitySweep(points, peak, bandwidth)


def square_size_for(flops: float) -> int:
    """The smallest multiple of ``ROOF_TILE`` whose square matmul does at least ``flops``.

    Sizes off the BLAS blocking run slower: a 1626 x 1626 matmul reached 141 GFLOP/s
    here, 1536 and 1792 reached 191-199.
    """
    return ROOF_TILE * math.ceil((flops / 2) ** (1 / 3) / ROOF_TILE)


def _skinny_matmul_cost(chosen: MicrobenchSizes, width: int, dtype: str) -> roofline.OpCost:
    rows = max(1, chosen.intensity_elements // width)
    return roofline.matmul(rows, width, width, dtype)


def _time_skinny_matmul(device: torch.device, chosen: MicrobenchSizes, width: int, dtype: str) -> float:
    """Best ms of ``x [M, width] @ w [width, width]`` with ``M * width`` = ``intensity_elements``."""
    rows = max(1, chosen.intensity_elements // width)
    tdtype = torch_dtype(dtype)
    with torch.inference_mode(), matmul_precision(dtype):
        x = torch.randn(rows, width, device=device).to(tdtype)
        w = torch.randn(width, width, device=device).to(tdtype)
        out = torch.empty(rows, width, device=device, dtype=tdtype)
        return best_ms(lambda: torch.matmul(x, w, out=out), device, repeats=chosen.repeats)
