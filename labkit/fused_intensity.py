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
"""Achieved FLOP/s over intensity x the memory roof of the same round, for the points well below the ridge
(see :meth:`FusedSweep.on_slope`). Ten runs of Lab 3 on the 2-core CI box gave 0.69-1.03 (``python
benchmarks/ten_runs.py --runs 10 3``, 2026-12-07); set against roofs of other moments, twenty earlier runs
gave 0.71-1.27. Bytes here are counted as STREAM counts them, without the read a cache makes before each
write, and a kernel that avoids that read beats the count; the upper end is the allowance the matmul
sweep's points get for it (:data:`~labkit.microbench.MOST_OVER_MEMORY_ROOF`: write-allocate, with the noise)."""
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
    """The chain at each length, timed round by round beside the memory roof of each round, and a compute peak."""

    costs: list[roofline.OpCost]
    round_ms: list[list[float]]
    """For each chain length, its time in each round (the best of a few calls)."""
    round_roofs: list[float]
    """The memory roof measured in each round, STREAM and the ReLU on the chains' arrays."""
    peak_flops_per_s: float

    def __post_init__(self) -> None:
        if len(self.costs) != len(self.round_ms) or any(len(ms) != len(self.round_roofs) for ms in self.round_ms):
            raise ValueError(f"round_ms must hold one time per round ({len(self.round_roofs)}) for each of the "
                             f"{len(self.costs)} costs, got {[len(ms) for ms in self.round_ms]}")

    @property
    def points(self) -> list[OpMeasurement]:
        """Each length at its median round, as the matmul sweep keeps its points."""
        return [OpMeasurement(cost, statistics.median_low(ms)) for cost, ms in zip(self.costs, self.round_ms)]

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """The median round's memory roof: the one the plot draws and the ridge divides by."""
        return statistics.median(self.round_roofs)

    @property
    def ridge(self) -> float:
        return roofline.ridge_point(self.peak_flops_per_s, self.bandwidth_bytes_per_s)

    def of_slope(self, point: OpMeasurement) -> float:
        """Achieved FLOP/s over intensity x the memory roof, round by round against that round's roof; the median."""
        ms = self.round_ms[[c.name for c in self.costs].index(point.cost.name)]
        return statistics.median(point.cost.flops / (t / 1e3) / (point.cost.intensity * roof)
                                 for t, roof in zip(ms, self.round_roofs))

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
    roof again, STREAM and the ReLU on the chain's own arrays, and each chain is judged against the roof
    of its own round (:meth:`FusedSweep.of_slope`). A shared host's bandwidth swings between seconds:
    set against the best roof of other moments, the chains sat at 0.45-0.76 of it in seven of ten runs
    of Lab 3 (2026-12-07), and against the best roof of their own three rounds at 0.53-0.60 in one run
    of ten the same day. ``roof``, the run's one roof, gets every measurement.
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
    round_ms: list[list[float]] = [[] for _ in lengths]
    round_roofs: list[float] = []
    relu = roofline.elementwise(numel, "float32", name="relu")
    for _ in tqdm(range(rounds), desc="fused chains", leave=False):
        stream = roof.measure_now(device)
        relu_bytes_per_s = relu.bytes_moved / (best_ms(lambda: torch.clamp(x, min=0, out=out), device,
                                                       repeats=repeats) / 1e3)
        roof.include("relu", relu_bytes_per_s)
        round_roofs.append(max(stream, relu_bytes_per_s))
        for times, chain in zip(round_ms, chains.values()):
            times.append(best_ms(lambda chain=chain: chain(x, out), device, repeats=repeats))
    return FusedSweep([chain_cost(numel, k) for k in lengths], round_ms, round_roofs, peak_flops_per_s)
