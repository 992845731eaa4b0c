"""The roofline's sloped part, reached: one fused kernel whose FLOPs per byte we turn like a knob.

Each element of ``x`` is read once and its result written once to a preallocated ``out``; in between it
goes through ``k`` multiply-adds (``y = y * a + b``) that ``torch.compile`` fuses into one kernel, so the
intermediates stay in registers. The bytes stay fixed while the FLOPs grow with ``k``: ``2k`` FLOPs for
8 bytes in float32, an intensity of ``k / 4`` FLOP/byte. Below the ridge such a kernel should stream
its bytes at the memory roof, so its FLOP/s should be intensity x bandwidth: the sloped part of the
roofline. Lab 3's matmul sweep does not show that part (a skinny matmul is a poorly used matmul
kernel, far under the slope, not a streaming one), and written eagerly this chain would not either:
each multiply and each add is then a pass over memory, a quarter of a FLOP per byte whatever ``k``.

Fusing is what moves the chain up the slope, which is why the same compiler that fuses Lab 3's
memory-bound chain is used here (:func:`labkit.fusion.compiler_missing` says where it cannot run).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable

import torch
from tqdm.auto import tqdm

from labkit import roofline
from labkit.microbench import MOST_OVER_MEMORY_ROOF, MemoryRoof, OpMeasurement, best_ms, sizes

CHAIN_LENGTHS = (1, 2, 4, 8, 16)
"""Multiply-adds per element: 0.25 to 4 FLOP/byte in float32, from far below a CPU's ridge to near it."""
SLOPE_BAND = (0.6, MOST_OVER_MEMORY_ROOF)
"""Achieved FLOP/s over intensity x the memory roof, for the points well below the ridge (see
:meth:`FusedSweep.on_slope`). Twenty runs of Lab 3 on the 2-core CI box gave 0.71-1.27 (``python
benchmarks/ten_runs.py --runs 10 03``, twice): the compiled chain streamed up to a quarter faster than
the STREAM kernels and the ReLU that set the roof, in the runs where they measured slowest. Bytes here
are counted as STREAM counts them, without the read a cache makes before each write, and a kernel
that avoids that read beats the count; the upper end is the allowance the matmul sweep's points get
for it (:data:`~labkit.microbench.MOST_OVER_MEMORY_ROOF`: write-allocate, with the noise)."""
BELOW_RIDGE = 0.25
"""A point is well below the ridge when its intensity is at most this share of the ridge: there the
kernel's few FLOPs per element hide under the memory traffic."""


def chain_cost(numel: int, k: int) -> roofline.OpCost:
    """``k`` multiply-adds per float32 element, one read and one write: ``2k`` FLOPs per 8 bytes."""
    return roofline.elementwise(numel, "float32", flops_per_element=2 * k,
                                name=f"{k} multiply-add{'s' if k > 1 else ''}")


def _chain_into(x: torch.Tensor, out: torch.Tensor, k: int) -> None:
    y = x
    for _ in range(k):
        y = y * 0.999 + 0.001
    out.copy_(y)


def compiled_chain(k: int) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """One kernel doing ``k`` multiply-adds per element of ``x`` into ``out`` (compiled on first call)."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    compiled = torch.compile(_chain_into, dynamic=False)
    return lambda x, out: compiled(x, out, k)


@dataclass(frozen=True)
class FusedSweep:
    """The chain at each length, measured, beside the run's memory roof and a compute peak."""

    points: list[OpMeasurement]
    bandwidth_bytes_per_s: float
    peak_flops_per_s: float

    @property
    def ridge(self) -> float:
        return roofline.ridge_point(self.peak_flops_per_s, self.bandwidth_bytes_per_s)

    def of_slope(self, point: OpMeasurement) -> float:
        """Achieved FLOP/s over what the sloped roof allows at the point's intensity."""
        return point.flops_per_s / (point.cost.intensity * self.bandwidth_bytes_per_s)

    def on_slope(self) -> list[OpMeasurement]:
        """The points well below the ridge (:data:`BELOW_RIDGE`), where the roofline puts them on its slope."""
        return [p for p in self.points if p.cost.intensity <= BELOW_RIDGE * self.ridge]


def measure(device: torch.device | str, roof: MemoryRoof, peak_flops_per_s: float, *,
            lengths: tuple[int, ...] = CHAIN_LENGTHS, rounds: int = 3) -> FusedSweep:
    """Each chain length timed in rounds that take turns with the roof, on arrays the size of Lab 3's ops.

    The preallocated residual add and ReLU are STREAM kernels that count towards the roof
    (:meth:`MemoryRoof.include`), and the chain is the same kind of kernel, so it runs on arrays of
    their size. On the STREAM kernels' larger arrays it ran at 0.52-0.75 of a roof that the ops' smaller
    working set (part of it in a large last-level cache) had set, in four runs. Each round measures the
    roof again, STREAM and the ReLU on the chain's own arrays, so that one slow moment of the ReLU
    timed earlier does not set it (in two of ten runs it had, and the chain streamed 1.26x that roof;
    measured again in turns, at most 1.27x in twenty runs). Nor does a fast one: the chains are set against
    the roof of these rounds alone, not the best ``roof`` saw all run. In seven of ten runs of Lab 3 on a
    shared host (2026-12-07) the roof measured during the matmul sweep had reached 50-67 GB/s, against
    28-36 GB/s at the lab's first measurement, and the chains then sat at 0.45-0.76 of it. ``roof`` gets
    this ReLU too. Each point keeps its median round (each round the best of
    a few calls), as the matmul sweep does, and the roof its best.
    """
    if rounds < 1 or not lengths or min(lengths) < 1:
        raise ValueError(f"rounds must be >= 1 and lengths chain lengths >= 1, got {rounds} and {lengths}")
    device = torch.device(device)
    chosen = sizes()
    numel = chosen.op_numel_rows * chosen.op_numel_cols
    x = torch.rand(numel, device=device)
    out = torch.empty_like(x)
    chains = {k: compiled_chain(k) for k in lengths}
    for k, chain in tqdm(chains.items(), desc="compiling the chains", leave=False):
        chain(x, out)
    repeats = chosen.repeats
    point_ms: dict[int, list[float]] = {k: [] for k in lengths}
    relu = roofline.elementwise(numel, "float32", name="relu")
    beside = MemoryRoof(roof.numel, roof.dtype, repeats=roof.repeats)   # the roof at the chains' own moments
    for _ in tqdm(range(rounds), desc="fused chains", leave=False):
        beside.measure(device)
        relu_ms = best_ms(lambda: torch.clamp(x, min=0, out=out), device, repeats=repeats)
        beside.include("relu", relu.bytes_moved / (relu_ms / 1e3))
        for k, chain in chains.items():
            point_ms[k].append(best_ms(lambda chain=chain: chain(x, out), device, repeats=repeats))
    points = [OpMeasurement(chain_cost(numel, k), statistics.median_low(point_ms[k])) for k in lengths]
    roof.include("relu", beside.streamed["relu"])
    return FusedSweep(points, beside.bytes_per_s, peak_flops_per_s)
