"""One kernel at rising arithmetic intensity: does it climb the memory roof and flatten at the compute roof?

Lab 3's sweep, ``x [M, K] @ w [K, K]`` with ``M * K`` fixed: every call moves about
the same bytes while its FLOPs grow with K, a knob from far below the ridge to far
above it. The roofs and the ops live in :mod:`labkit.microbench`; this module
times the sweep against them.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from labkit import roofline
from labkit.microbench import (MOST_OVER_MEMORY_ROOF, MemoryRoof, MicrobenchSizes, OpMeasurement, best_ms,
                               matmul_precision, sizes, square_matmul_flops, torch_dtype)

ROOF_TILE = 256
"""Square roof matmuls are sized in multiples of this (see :func:`square_size_for`)."""


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

    def earliest_crossover(self, share: float = 0.5) -> float:
        """The lowest intensity at which the roofline lets any kernel reach ``share`` of the compute peak.

        Bare, that is ``share`` of the ridge. A point below the ridge may beat the
        memory roof by the reads STREAM's count leaves out and the noise
        (:meth:`over_memory_roof`'s allowance), so it may get there that much
        earlier. On a 2-core CI box, the ``ci`` profile's skinny matmul at
        intensity 4 reached 0.40-0.49 of the peak in five sweeps (ridges of
        10.6-11.5 FLOP/byte), and was the first point past half of it in four of
        ten runs of Lab 3 (ridges of 8.9-9.6, so under half the ridge); there
        this bound was 2.5-3.3 FLOP/byte.
        """
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share}")
        return share * self.ridge / MOST_OVER_MEMORY_ROOF

    def climb(self) -> float:
        """Achieved FLOP/s of the most intense point over the least intense one."""
        return self.points[-1].flops_per_s / self.points[0].flops_per_s

    def over_memory_roof(self) -> list[OpMeasurement]:
        """Points below the ridge that beat intensity x bandwidth by more than write-allocate and the noise allow
        (:data:`~labkit.microbench.MOST_OVER_MEMORY_ROOF`): a wrong byte count."""
        return [p for p in self.points if p.cost.intensity < self.ridge
                and p.flops_per_s > p.cost.intensity * self.bandwidth_bytes_per_s * MOST_OVER_MEMORY_ROOF]


def measure(device: torch.device | str, dtype: str | None = None,
                    chosen: MicrobenchSizes | None = None, *, rounds: int = 3,
                    roof: MemoryRoof | None = None) -> IntensitySweep:
    """``x [M, K] @ w [K, K]`` for rising K, with ``M * K`` fixed.

    Every call moves about the same bytes (x in, the result out) while its FLOPs
    grow with K, so intensity is about K / element size (``2MK^2`` FLOPs over
    ``(2MK + K^2)`` elements): a knob from far
    below the ridge to far above it, with one kernel per call. Memory-bound
    points should climb with intensity and compute-bound ones flatten at the
    compute roof. A real kernel turns later than the roofline's corner: how
    much later is what this measures.

    The two roofs are measured here, taking turns with the points round by round.
    Each roof keeps its best round and each point its median round, so one
    quiet moment of a shared machine does not set a point. Points may still
    beat the memory roof by STREAM's uncounted write-allocate reads and the noise
    (:data:`~labkit.microbench.MOST_OVER_MEMORY_ROOF`, the allowance
    :meth:`IntensitySweep.over_memory_roof` asserts): on a busy host, skinny
    matmuls ran 1.29-1.40x the roof, once in their median round. The memory
    roof is the run's one :class:`MemoryRoof` when one is given. Roofs timed a minute earlier on a shared
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
    roof = roof or MemoryRoof(chosen.bandwidth_numel, repeats=chosen.repeats)
    roof_n = square_size_for(_skinny_matmul_cost(chosen, max(chosen.intensity_widths), dtype).flops)
    point_ms: list[list[float]] = [[] for _ in chosen.intensity_widths]
    compute_roof = 0.0
    steps = tqdm(total=rounds * (len(chosen.intensity_widths) + 1), desc="intensity sweep", leave=False)
    with steps:
        for _ in range(rounds):
            compute_roof = max(compute_roof, square_matmul_flops(device, roof_n, dtype, repeats=chosen.repeats))
            roof.measure(device)
            steps.update()
            for i, width in enumerate(chosen.intensity_widths):
                point_ms[i].append(_time_skinny_matmul(device, chosen, width, dtype))
                steps.update()
    points = [OpMeasurement(_skinny_matmul_cost(chosen, width, dtype), statistics.median_low(ms))
              for width, ms in zip(chosen.intensity_widths, point_ms)]
    # The compute roof is the best FLOP/s any measurement reached (as in measure_matmul_flops).
    peak = max(compute_roof, *(p.flops_per_s for p in points))
    return IntensitySweep(points, peak, roof.bytes_per_s)


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
