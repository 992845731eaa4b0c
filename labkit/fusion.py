"""Fusion: do a chain of memory-bound ops in one pass over memory instead of four.

``out = relu(x + bias) * scale + residual`` is four cheap ops. Run one at a
time, each reads its input from main memory and writes its result back, so the
intermediates cross the memory bus twice each. Fused, the chain reads ``x`` and
``residual`` once and writes ``out`` once; the intermediates stay in registers.
The ops are memory-bound, so time should fall roughly as bytes do: the roofline
model predicts the ratio, the clock checks it.

The fused form is one kernel that ``torch.compile`` generates: Triton on a GPU,
a C++ loop on the CPU (about 20 s to compile the first time on a 2-core box,
seconds once torch's cache holds it). Where no compiler is available, a
hand-fused *tiled* form runs the same four ops on cache-sized tiles instead: it
keeps the intermediates out of main memory but pays each op's overhead per tile,
so on a CPU whose memory is fast next to its cores it recovers only part of the
byte ratio (1.1-1.7x against 3.0x predicted, measured 2026-12-03), which is why
it is only the fallback.
"""

from __future__ import annotations

import importlib.util
import shutil
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from labkit import roofline
from labkit.devices import interleaved_best_ms, time_ms
from labkit.microbench import torch_dtype
from labkit.profiles import profile, require_at_least

TILE_BYTES = 2**20
"""Tile size for the hand-fused form: small enough that each tile's temporary stays in the on-chip caches."""

AGREEMENT_FACTOR = 2.0
""""Roughly the ratio": measured speedup within this factor of the predicted byte ratio."""

METHODS = ("tiled", "compile")


@dataclass(frozen=True)
class FusionSizes:
    rows: int
    hidden: int
    dtype: str
    method: str
    repeats: int

    def __post_init__(self) -> None:
        require_at_least(self, 1, "rows", "hidden", "repeats")
        if self.method not in METHODS:
            raise ValueError(f"FusionSizes.method must be one of {METHODS}, got {self.method!r}")


SIZES = {
    "ci": FusionSizes(rows=8192, hidden=4096, dtype="float32", method="compile", repeats=9),
    "gpu": FusionSizes(rows=32768, hidden=8192, dtype="bfloat16", method="compile", repeats=10),
}
SIZES["multi-gpu"] = SIZES["gpu"]
"""Tensors of 128 MiB (ci) and more: a chain on tensors that fit the last-level cache would not be memory-bound."""


def compiler_missing(device: torch.device | str) -> str | None:
    """Why ``torch.compile`` cannot generate a kernel for ``device`` here, or None if it can."""
    if torch.device(device).type == "cuda":
        return None if importlib.util.find_spec("triton") else "Triton is not installed"
    if not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
        return "no C++ compiler (g++, c++ or clang++) on PATH"
    return None


def pick_method(method: str, device: torch.device | str) -> str:
    """``method``, or the tiled form when a compiled kernel cannot be built on ``device``."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return "tiled" if method == "compile" and compiler_missing(device) else method


def unfused_costs(rows: int, hidden: int, dtype: str | torch.dtype = "float32") -> list[roofline.OpCost]:
    """The chain as four kernels, each a full pass over ``rows x hidden`` elements."""
    n = rows * hidden
    size = roofline.dtype_bytes(dtype)
    bias_add = roofline.elementwise(n, dtype, name="bias add")
    bias_add = roofline.OpCost("bias add", bias_add.flops, bias_add.bytes_moved + hidden * size, bias_add.dtype)
    return [
        bias_add,
        roofline.elementwise(n, dtype, name="relu"),
        roofline.elementwise(n, dtype, name="scale"),
        roofline.elementwise(n, dtype, inputs=2, name="residual add"),
    ]


def fused_cost(rows: int, hidden: int, dtype: str | torch.dtype = "float32") -> roofline.OpCost:
    """The chain as one kernel: read ``x``, ``residual`` and ``bias``, write ``out``."""
    n = rows * hidden
    size = roofline.dtype_bytes(dtype)
    return roofline.OpCost("fused chain", 4.0 * n, float((3 * n + hidden) * size), roofline.dtype_name(dtype))


@dataclass(frozen=True)
class FusionPrediction:
    unfused_bytes: float
    fused_bytes: float

    @property
    def byte_ratio(self) -> float:
        """How many times fewer bytes the fused form moves; for memory-bound ops, the predicted speedup."""
        return self.unfused_bytes / self.fused_bytes


def predict(rows: int, hidden: int, dtype: str | torch.dtype = "float32") -> FusionPrediction:
    return FusionPrediction(sum(c.bytes_moved for c in unfused_costs(rows, hidden, dtype)),
                            fused_cost(rows, hidden, dtype).bytes_moved)


def eager_chain(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, scale: float) -> torch.Tensor:
    """The chain as people write it: every op allocates a fresh intermediate."""
    return torch.relu(x + bias) * scale + residual


def unfused_chain(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, scale: float,
                  out: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """Baseline: four passes over memory into a reused full-size buffer (no allocation cost)."""
    torch.add(x, bias, out=scratch)
    scratch.relu_()
    scratch.mul_(scale)
    return torch.add(scratch, residual, out=out)


def tiled_fused_chain(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, scale: float,
                      out: torch.Tensor, tile_rows: int, *, workers: int = 1) -> torch.Tensor:
    """Hand-fused: the chain per tile (the scale folded into the residual add), so each
    tile's intermediate lives in cache and only ``x``, ``residual`` and ``out`` reach memory.

    On the CPU ``workers`` threads each take a slab of rows with one intra-op
    thread apiece, as a fused kernel's thread blocks would; forking a thread team
    for every small tile op would cost more than the op.
    """
    if tile_rows < 1 or workers < 1:
        raise ValueError(f"tile_rows and workers must be >= 1, got {tile_rows}, {workers}")
    if workers == 1:
        _tiles(x, bias, residual, scale, out, tile_rows)
        return out
    bounds = [x.shape[0] * i // workers for i in range(workers + 1)]
    errors: list[BaseException] = []

    def slab(lo: int, hi: int) -> None:
        try:
            torch.set_num_threads(1)
            _tiles(x[lo:hi], bias, residual[lo:hi], scale, out[lo:hi], tile_rows)
        except BaseException as err:  # re-raised in the caller below
            errors.append(err)

    threads = [threading.Thread(target=slab, args=(lo, hi)) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return out


def _tiles(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, scale: float,
           out: torch.Tensor, tile_rows: int) -> None:
    tile = torch.empty(min(tile_rows, x.shape[0]), x.shape[1], dtype=x.dtype, device=x.device)
    for start in range(0, x.shape[0], tile_rows):
        stop = min(start + tile_rows, x.shape[0])
        t = tile[: stop - start]
        torch.add(x[start:stop], bias, out=t)
        t.relu_()
        torch.add(residual[start:stop], t, alpha=scale, out=out[start:stop])


def _chain_into(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, scale: float,
                out: torch.Tensor) -> torch.Tensor:
    """The chain written into ``out``: compiled, one loop reads x and residual and writes out."""
    return torch.add(residual, torch.relu(x + bias), alpha=scale, out=out)


def tile_rows_for(hidden: int, dtype: str | torch.dtype, tile_bytes: int = TILE_BYTES) -> int:
    return max(1, tile_bytes // (hidden * roofline.dtype_bytes(dtype)))


def fused_chain(method: str, hidden: int, dtype: str) -> Callable[..., torch.Tensor]:
    """``f(x, bias, residual, scale, out)`` computing the chain in one pass, by ``method``."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method == "compile":
        return torch.compile(_chain_into, dynamic=False)
    tile_rows = tile_rows_for(hidden, dtype)

    def tiled(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, scale: float, out: torch.Tensor):
        workers = torch.get_num_threads() if x.device.type == "cpu" else 1
        return tiled_fused_chain(x, bias, residual, scale, out, tile_rows, workers=workers)

    return tiled


@dataclass(frozen=True)
class FusionResult:
    method: str
    prediction: FusionPrediction
    eager_ms: float
    unfused_ms: float
    fused_ms: float

    @property
    def measured_speedup(self) -> float:
        return self.unfused_ms / self.fused_ms

    @property
    def agrees(self) -> bool:
        """Direction and rough size: fused is faster, by the predicted ratio within ``AGREEMENT_FACTOR``."""
        ratio = self.measured_speedup / self.prediction.byte_ratio
        return self.measured_speedup > 1 and 1 / AGREEMENT_FACTOR <= ratio <= AGREEMENT_FACTOR


def compare(device: torch.device | str | None = None, sizes: FusionSizes | None = None) -> FusionResult:
    """Time the eager, unfused and fused chains on the same data; check they compute the same thing.

    Unfused and fused are timed in alternating rounds (:func:`~labkit.devices.interleaved_best_ms`),
    so both see the same neighbours on a shared machine.
    """
    sizes = sizes or profile().pick(SIZES)
    if sizes.rows < 1 or sizes.hidden < 1:
        raise ValueError(f"rows and hidden must be >= 1, got {sizes.rows}, {sizes.hidden}")
    device = torch.device(device or profile().device)
    method = pick_method(sizes.method, device)
    tdtype = torch_dtype(sizes.dtype)
    x = torch.randn(sizes.rows, sizes.hidden, device=device).to(tdtype)
    residual = torch.randn_like(x)
    bias = torch.randn(sizes.hidden, device=device).to(tdtype)
    out, scratch = torch.empty_like(x), torch.empty_like(x)
    scale = 0.5
    fused = fused_chain(method, sizes.hidden, sizes.dtype)
    with torch.no_grad():
        expected = unfused_chain(x, bias, residual, scale, out, scratch).clone()
        # a fused kernel rounds once where the unfused chain rounds after every op: 16-bit results differ by ulps
        loose = {} if roofline.dtype_bytes(sizes.dtype) >= 4 else {"rtol": 2e-2, "atol": 6e-2}
        torch.testing.assert_close(fused(x, bias, residual, scale, torch.empty_like(x)), expected, **loose)
        del expected
        eager_ms = min(time_ms(lambda: eager_chain(x, bias, residual, scale), device=device, repeats=1))
        timings = interleaved_best_ms({
            "unfused": lambda: unfused_chain(x, bias, residual, scale, out, scratch),
            "fused": lambda: fused(x, bias, residual, scale, out),
        }, device=device, repeats=sizes.repeats)
    return FusionResult(method, predict(sizes.rows, sizes.hidden, sizes.dtype),
                        eager_ms, timings["unfused"], timings["fused"])
