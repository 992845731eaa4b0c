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
import statistics
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


WRITE_ALLOCATE_ALLOWANCE = 1.5
"""How far a kernel may beat the memory roof by byte count alone. STREAM counts the bytes a kernel reads and
writes, not the read a CPU does of each cache line before its first write to it (write-allocate): its copy
moves 3 bytes for the 2 it counts, its add and triad 4 for 3. A kernel that writes with streaming stores
skips that read, so at the same DRAM rate it moves up to 1.5x the roof by the same count. On a busy 2-core
host the sweep's skinny matmuls ran 1.29-1.40x the roof in 3 of 13 sweeps, once in their median round."""

MOST_OVER_MEMORY_ROOF = WRITE_ALLOCATE_ALLOWANCE * (1 + MEASUREMENT_TOLERANCE)
"""The most a measured kernel may beat the memory roof by its byte count: write-allocate, then the noise.
Lab 3's unfused fusion chain, two of whose four passes write in place, moved its counted bytes at 0.66-1.08x
the roof in ten runs on a 2-core box; timed as a no-op, thousands of times it."""


STREAM_LIKE_OPS = ("residual add", "relu")
"""Ops that are STREAM kernels under another name once they write into a preallocated output: add, and scale."""


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


class MemoryRoof:
    """The run's one memory roof: the best bandwidth any of its streaming measurements reached.

    Every experiment of Lab 3 measures it again, taking turns with its own points,
    and every upper bound (nothing beats the roof) reads this one figure, the best;
    lower bounds (an op streams most of the roof, the fused chain's points against
    intensity x the roof) are set against the roof measured in the same round
    (:meth:`measure_now`), the median round kept. On a shared machine a roof timed once, at
    a busy moment, sits below what the ops of a quieter moment move (a run here
    printed 31.6 GB/s at the start while its sweep's roof, timed later, reached 56).
    The preallocated residual add and ReLU are STREAM's own add and scale kernels
    under other names (:data:`STREAM_LIKE_OPS`), so their timings count too
    (:meth:`include`): two timings of one kernel differ by the machine's noise, and
    once the add ran 1.12x the roof its STREAM twin had set a moment before.
    """

    def __init__(self, numel: int, dtype: str = "float32", *, repeats: int = 5) -> None:
        if numel < 1 or repeats < 1:
            raise ValueError(f"numel and repeats must be >= 1, got {numel}, {repeats}")
        self.numel, self.dtype, self.repeats = numel, dtype, repeats
        self.best: BandwidthResult | None = None
        self.streamed: dict[str, float] = {}
        self.measurements = 0

    @property
    def bytes_per_s(self) -> float:
        if self.best is None:
            raise ValueError("the memory roof has not been measured yet: call measure(device) first")
        return max([self.best.peak_bytes_per_s, *self.streamed.values()])

    @property
    def by_kernel_bytes_per_s(self) -> dict[str, float]:
        """Each STREAM kernel's best, and each included op's: the roof is the largest."""
        if self.best is None:
            raise ValueError("the memory roof has not been measured yet: call measure(device) first")
        return {**self.best.by_kernel_bytes_per_s, **self.streamed}

    def measure(self, device: torch.device | str) -> float:
        """One more STREAM measurement; the roof keeps the best so far and returns it."""
        self.measure_now(device)
        return self.bytes_per_s

    def measure_now(self, device: torch.device | str) -> float:
        """One more STREAM measurement, kept towards the roof; returns this one's best kernel.

        A lower bound (an op reaching most of the roof) is judged against the roof of its own moment:
        on a shared host one STREAM measurement reached 52.7 GB/s between rounds at 29-35, while the
        ReLU timed a second later streamed 24.1. An upper bound (nothing beats the roof) is judged
        against the best the run saw, :attr:`bytes_per_s`.
        """
        found = measure_bandwidth(device, self.numel, self.dtype, repeats=self.repeats)
        self.measurements += 1
        if self.best is None or found.peak_bytes_per_s > self.best.peak_bytes_per_s:
            self.best = found
        return found.peak_bytes_per_s

    def include(self, name: str, bytes_per_s: float) -> float:
        """Count ``name``, a STREAM kernel under another name, timed at ``bytes_per_s``; returns the roof."""
        if name not in STREAM_LIKE_OPS or not bytes_per_s > 0:
            raise ValueError(f"name must be one of {STREAM_LIKE_OPS} and bytes_per_s > 0, got {name!r}, {bytes_per_s}")
        self.streamed[name] = max(self.streamed.get(name, 0.0), bytes_per_s)
        return self.bytes_per_s


def measure_matmul_flops(device: torch.device | str, n: int, dtype: str = "float32", *, repeats: int = 5) -> float:
    """Best FLOP/s of square matmuls of size ``n/2`` and ``n``: the compute roof for ``dtype``.

    Two sizes because the fastest size depends on the caches and the library's
    blocking; the roof is the best any of them reached.
    """
    roofline.matmul(n, n, n, dtype)
    return max(square_matmul_flops(device, size, dtype, repeats=repeats) for size in sorted({max(1, n // 2), n}))


def square_operands(device: torch.device | str, n: int, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Two random ``n x n`` matrices of ``dtype`` on ``device``: a square matmul's inputs."""
    tdtype = torch_dtype(dtype)
    return tuple(torch.randn(n, n, device=torch.device(device)).to(tdtype) for _ in range(2))


def square_matmul_flops(device: torch.device | str, n: int, dtype: str = "float32", *, repeats: int = 5) -> float:
    """Best FLOP/s of one ``n x n @ n x n`` matmul."""
    device = torch.device(device)
    a, b = square_operands(device, n, dtype)
    with matmul_precision(roofline.dtype_name(dtype)):
        ms = best_ms(lambda: a @ b, device, warmup=2, repeats=repeats)
    return roofline.matmul(n, n, n, dtype).flops / (ms / 1e3)


@dataclass(frozen=True)
class DevicePeaks:
    """This device's measured roofs."""

    device: str
    roof: MemoryRoof
    matmul_flops_per_s: dict[str, float]

    @property
    def bandwidth(self) -> BandwidthResult:
        """The best STREAM measurement so far (later experiments may raise it)."""
        assert self.roof.best is not None
        return self.roof.best

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.roof.bytes_per_s

    def ridge(self, dtype: str) -> float:
        return roofline.ridge_point(self.matmul_flops_per_s[roofline.dtype_name(dtype)], self.bandwidth_bytes_per_s)

    def as_spec(self, name: str = "this device (measured)") -> roofline_devices.DeviceSpec:
        return roofline_devices.measured_spec(name, self.matmul_flops_per_s, self.bandwidth_bytes_per_s)


def measure_peaks(device: torch.device | str | None = None, chosen: MicrobenchSizes | None = None) -> DevicePeaks:
    """Peak bandwidth and peak matmul FLOP/s per dtype, with a progress bar."""
    chosen = chosen or sizes()
    device = torch.device(device or profile().device)
    roof = MemoryRoof(chosen.bandwidth_numel, repeats=chosen.repeats)
    steps = tqdm(["bandwidth", *chosen.matmul_n], desc="measuring peaks", leave=False)
    flops: dict[str, float] = {}
    for step in steps:
        if step == "bandwidth":
            roof.measure(device)
        else:
            flops[step] = measure_matmul_flops(device, chosen.matmul_n[step], step, repeats=chosen.repeats)
    return DevicePeaks(str(device), roof, flops)


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


ALLOCATING_ADD = "residual add (allocates)"
"""``x + y`` as people write it: the same bytes as the residual add, plus a fresh output every call."""


def transformer_ops(device: torch.device | str, chosen: MicrobenchSizes) -> OpSuite:
    """Residual add, ReLU, softmax, LayerNorm at ``rows x cols``, and a sweep of square matmuls.

    The memory-bound ops write into one preallocated output, so their time is the
    bytes they move. A fresh output per call (``x + y``) also pays for new memory:
    on a CPU every page is faulted in on first touch, several times the cost of the
    add itself; :data:`ALLOCATING_ADD` times that form beside the preallocated one.
    """
    device = torch.device(device)
    dtype = roofline.dtype_name(chosen.op_dtype)
    tdtype = torch_dtype(dtype)
    rows, cols = chosen.op_numel_rows, chosen.op_numel_cols
    x = torch.randn(rows, cols, device=device).to(tdtype)
    y = torch.randn(rows, cols, device=device).to(tdtype)
    out = torch.empty_like(x)
    weight, bias = torch.ones(cols, device=device, dtype=tdtype), torch.zeros(cols, device=device, dtype=tdtype)
    stats = [torch.empty_like(t) for t in torch.native_layer_norm(x, [cols], weight, bias, 1e-5)[1:]]  # dtypes vary by device
    suite = OpSuite(device, dtype)
    suite.ops += [
        (roofline.elementwise(rows * cols, dtype, inputs=2, name="residual add"), lambda: torch.add(x, y, out=out)),
        (roofline.elementwise(rows * cols, dtype, name="relu"), lambda: torch.clamp(x, min=0, out=out)),
        (roofline.softmax(rows, cols, dtype), lambda: torch.softmax(x, -1, out=out)),
        (roofline.layer_norm(rows, cols, dtype), lambda: torch.ops.aten.native_layer_norm.out(
            x, [cols], weight, bias, 1e-5, out0=out, out1=stats[0], out2=stats[1])),
        (roofline.elementwise(rows * cols, dtype, inputs=2, name=ALLOCATING_ADD), lambda: x + y),
    ]
    for n in chosen.matmul_sweep:
        a = torch.randn(n, n, device=device).to(tdtype)
        b = torch.randn(n, n, device=device).to(tdtype)
        suite.ops.append((roofline.matmul(n, n, n, dtype), lambda a=a, b=b: a @ b))
    return suite


@dataclass(frozen=True)
class TimedOps:
    """The ops, each at its best time, and each op's share of the memory roof measured beside it."""

    ops: list[OpMeasurement]
    roof_shares: dict[str, float]
    """Op name -> the median over rounds of the op's bytes/s over the STREAM roof measured in the same round."""

    def share(self, name: str) -> float:
        if name not in self.roof_shares:
            raise ValueError(f"name must be one of the timed ops {sorted(self.roof_shares)}, got {name!r}")
        return self.roof_shares[name]


def measure_ops(device: torch.device | str | None = None, chosen: MicrobenchSizes | None = None,
                roof: MemoryRoof | None = None, *, rounds: int = 3) -> TimedOps:
    """Each op's best time over ``rounds``, each round beside a STREAM measurement of its own.

    An op's share of the roof is taken round by round, the op against the STREAM kernels of the same
    moment, and the median over rounds kept: a shared host's bandwidth swings between seconds, and the
    ReLU set against a STREAM measurement a second before it sat at 0.46 of it in one round of sixteen
    on the 2-core CI box (2026-12-07; 0.77-1.19 in the other fifteen), and a best-against-best comparison
    takes that one fast STREAM round as the roof. ``roof``, the run's one roof,
    gets every STREAM measurement and the STREAM-like ops' best rates (:meth:`MemoryRoof.include`).
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    chosen = chosen or sizes()
    device = torch.device(device or profile().device)
    suite = transformer_ops(device, chosen)
    roof = roof if roof is not None else MemoryRoof(chosen.bandwidth_numel, repeats=chosen.repeats)
    round_ms: list[list[float]] = [[] for _ in suite.ops]
    round_roof: list[float] = []
    with torch.inference_mode(), tqdm(total=rounds * len(suite.ops), desc="timing ops", leave=False) as steps:
        for _ in range(rounds):
            round_roof.append(roof.measure_now(device))
            for i, (_, fn) in enumerate(suite.ops):
                round_ms[i].append(best_ms(fn, device, repeats=chosen.repeats))
                steps.update()
    measured = [OpMeasurement(cost, min(times)) for (cost, _), times in zip(suite.ops, round_ms)]
    shares = {cost.name: statistics.median(cost.bytes_moved / (ms / 1e3) / stream
                                           for ms, stream in zip(times, round_roof))
              for (cost, _), times in zip(suite.ops, round_ms)}
    for m in measured:
        if m.cost.name in STREAM_LIKE_OPS:
            roof.include(m.cost.name, m.bytes_per_s)
    return TimedOps(measured, shares)


def memory_bound_ops(measurements: list[OpMeasurement], ridge: float) -> list[OpMeasurement]:
    """The measured ops whose intensity is below ``ridge``: their speed is their bandwidth."""
    return [m for m in measurements if m.cost.intensity < ridge]
