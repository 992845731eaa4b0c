"""Overlap moving the next batch with computing on this one.

Serially, every step waits for its input to arrive and the copy engine idles while
the compute units work. With two buffers the next batch is copied while this one
is computed, so a step costs ``max(copy, compute)`` instead of their sum.

On a GPU that needs three things: pinned (page-locked) host memory so the DMA
engine can read it without the CPU, ``non_blocking`` copies issued on a side
stream, and events so compute waits for its buffer and the copy waits until the
buffer it overwrites is no longer in use. On the CPU there is no DMA engine: a
background thread plays the copy engine while compute runs on the main thread.

**Emulated link (CPU only).** Host-to-device copies cross PCIe, far slower than
the memory the kernels read, and the DMA engine leaves the compute units alone.
A CPU memcpy is neither: it runs at memory speed on a core that shares caches and
bandwidth with compute. So on the CPU the copy is paced to ``link_bytes_per_s``
(copy a chunk, sleep until the link would have delivered it). The pacing is an
emulation, named as such, a parameter, and never used on a GPU, where the real
link sets the pace. ``link_bytes_per_s=None`` runs the raw memcpy.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from labkit.devices import synchronize
from labkit.plots import BASELINE, FIX
from labkit.profiles import profile, require_at_least


@dataclass(frozen=True)
class OverlapSizes:
    batches: int
    batch_rows: int
    features: int
    compute_width: int
    repeats: int
    link_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        require_at_least(self, 1, "batches", "batch_rows", "features", "compute_width", "repeats")
        if self.link_bytes_per_s is not None and self.link_bytes_per_s <= 0:
            raise ValueError(f"OverlapSizes.link_bytes_per_s must be > 0 or None, got {self.link_bytes_per_s}")


SIZES = {
    "ci": OverlapSizes(batches=16, batch_rows=1024, features=1024, compute_width=192, repeats=3,
                       link_bytes_per_s=2e9),
    "gpu": OverlapSizes(batches=16, batch_rows=4096, features=4096, compute_width=2048, repeats=3),
}
"""On the CPU a batch's compute is sized near its copy (2.1 ms at 2 GB/s): then overlap hides most of the
shorter lane, and at a quarter of the link (Exercise 3.2, :data:`labkit.exercises.lab03.LINK_SLOWDOWN`) the
overlapped and serial totals stay far apart. At width 64 a batch computed in 0.9 ms on a fast core; at half
the link (the exercise's rate then) the serial total came within 14-15% of the overlapped one, inside the
exercise's 15% tolerance, and the check accepted the wrong answer. At 192: 2.5 ms then, 1.7x from overlap
(four runs); 4.3-5.0 ms per batch in ten runs of Lab 3 on a busier day (2026-12-07)."""
LINK_CHUNK_BYTES = 2**20
SIZES["multi-gpu"] = SIZES["gpu"]
CUDA_EVENT_RESOLUTION_MS = 0.002
"""CUDA events time to about 0.5 us. A span's start and end are each read against the
run's first event, so a copy that ends exactly where the next compute begins can come
out overlapping it by a microsecond: the serial pipeline on an H200 showed such a
rounding overlap. Four times the resolution separates rounding from a real overlap,
which lasts a copy's length (milliseconds)."""


@dataclass
class PipelineRun:
    """One pass over the batches: total time and every copy / compute span for a timeline."""

    mode: str
    total_ms: float
    spans: list[tuple[str, float, float]] = field(default_factory=list)
    resolution_ms: float = 0.0
    """Below this, two spans' overlap is the timer's rounding, not concurrency (see :data:`CUDA_EVENT_RESOLUTION_MS`)."""

    def busy_ms(self, kind: str) -> float:
        return sum(duration for label, _, duration in self.spans if label == kind)

    def concurrent_ms(self) -> float:
        """Time during which a copy and a compute were both in flight: zero for the serial pipeline."""
        copies = [(start, start + duration) for label, start, duration in self.spans if label == "copy"]
        computes = [(start, start + duration) for label, start, duration in self.spans if label == "compute"]
        overlaps = (min(c1, k1) - max(c0, k0) for c0, c1 in copies for k0, k1 in computes)
        return sum(o for o in overlaps if o > self.resolution_ms)


def make_workload(device: torch.device | str, sizes: OverlapSizes) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Host batches (pinned when the target is a GPU) and a weight on the device."""
    device = torch.device(device)
    pin = device.type == "cuda"
    batches = [torch.randn(sizes.batch_rows, sizes.features).pin_memory() if pin
               else torch.randn(sizes.batch_rows, sizes.features) for _ in range(sizes.batches)]
    weight = torch.randn(sizes.features, sizes.compute_width, device=device) / sizes.features**0.5
    return batches, weight


def link_copy(dst: torch.Tensor, src: torch.Tensor, link_bytes_per_s: float | None) -> None:
    """Copy ``src`` into ``dst``; with a link rate, paced chunk by chunk to that rate (CPU emulation)."""
    if link_bytes_per_s is None:
        dst.copy_(src)
        return
    flat_dst, flat_src = dst.view(-1), src.view(-1)
    chunk = max(1, LINK_CHUNK_BYTES // src.element_size())
    start = time.perf_counter()
    for lo in range(0, flat_src.numel(), chunk):
        hi = min(lo + chunk, flat_src.numel())
        flat_dst[lo:hi].copy_(flat_src[lo:hi])
        due = start + hi * src.element_size() / link_bytes_per_s
        delay = due - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


def compute(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The step's work on one batch: a projection and a nonlinearity."""
    return torch.relu(x @ weight)


def serial_pipeline(batches: list[torch.Tensor], weight: torch.Tensor, *, compute_threads: int = 1,
                    link_bytes_per_s: float | None = None) -> PipelineRun:
    """Baseline: copy batch i, then compute on it, then copy batch i+1."""
    device = weight.device
    if device.type == "cuda":
        return _serial_cuda(batches, weight)
    with _threads(compute_threads):
        staging = torch.empty_like(batches[0])
        spans = []
        start = time.perf_counter()
        for batch in batches:
            t0 = time.perf_counter()
            link_copy(staging, batch, link_bytes_per_s)
            t1 = time.perf_counter()
            compute(staging, weight)
            t2 = time.perf_counter()
            spans += [("copy", (t0 - start) * 1e3, (t1 - t0) * 1e3), ("compute", (t1 - start) * 1e3, (t2 - t1) * 1e3)]
        return PipelineRun("serial", (time.perf_counter() - start) * 1e3, spans)


def overlapped_pipeline(batches: list[torch.Tensor], weight: torch.Tensor, *, compute_threads: int = 1,
                        link_bytes_per_s: float | None = None) -> PipelineRun:
    """The fix: two buffers; batch i+1 is copied while batch i is computed."""
    if weight.device.type == "cuda":
        return _overlapped_cuda(batches, weight)
    with _threads(compute_threads):
        return _overlapped_cpu(batches, weight, link_bytes_per_s)


class _threads:
    """Run with ``n`` intra-op threads, restoring the previous setting after."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"compute_threads must be >= 1, got {n}")
        self.n = n

    def __enter__(self) -> None:
        self.previous = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.previous)


def _overlapped_cpu(batches: list[torch.Tensor], weight: torch.Tensor, link_bytes_per_s: float | None) -> PipelineRun:
    buffers = [torch.empty_like(batches[0]) for _ in range(2)]
    free: queue.Queue[int] = queue.Queue()
    ready: queue.Queue[int | BaseException] = queue.Queue()
    for slot in range(2):
        free.put(slot)
    spans: list[tuple[str, float, float]] = []
    start = time.perf_counter()

    def copier() -> None:
        try:
            torch.set_num_threads(1)
            for batch in batches:
                slot = free.get()
                t0 = time.perf_counter()
                link_copy(buffers[slot], batch, link_bytes_per_s)
                spans.append(("copy", (t0 - start) * 1e3, (time.perf_counter() - t0) * 1e3))
                ready.put(slot)
        except BaseException as err:  # surfaced in the main thread, never swallowed
            ready.put(err)

    thread = threading.Thread(target=copier, name="labkit-prefetch", daemon=True)
    thread.start()
    for _ in batches:
        slot = ready.get()
        if isinstance(slot, BaseException):
            raise slot
        t0 = time.perf_counter()
        compute(buffers[slot], weight)
        spans.append(("compute", (t0 - start) * 1e3, (time.perf_counter() - t0) * 1e3))
        free.put(slot)
    thread.join()
    return PipelineRun("overlapped", (time.perf_counter() - start) * 1e3, spans)


def _cuda_spans(origin: torch.cuda.Event, events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]]) -> list:
    return [(label, origin.elapsed_time(begin), begin.elapsed_time(end)) for label, begin, end in events]


def _event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


def _serial_cuda(batches: list[torch.Tensor], weight: torch.Tensor) -> PipelineRun:
    device = weight.device
    staging = torch.empty(batches[0].shape, device=device)
    events = []
    synchronize(device)
    origin = _event()
    origin.record()
    for batch in batches:
        b0, b1, b2 = _event(), _event(), _event()
        b0.record()
        staging.copy_(batch)
        b1.record()
        compute(staging, weight)
        b2.record()
        events += [("copy", b0, b1), ("compute", b1, b2)]
    end = _event()
    end.record()
    end.synchronize()
    return PipelineRun("serial", origin.elapsed_time(end), _cuda_spans(origin, events), CUDA_EVENT_RESOLUTION_MS)


def _overlapped_cuda(batches: list[torch.Tensor], weight: torch.Tensor) -> PipelineRun:
    device = weight.device
    main = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    buffers = [torch.empty(batches[0].shape, device=device) for _ in range(2)]
    copied = [torch.cuda.Event() for _ in range(2)]
    consumed = [torch.cuda.Event() for _ in range(2)]
    events = []
    synchronize(device)
    origin = _event()
    origin.record(main)
    side.wait_event(origin)

    def prefetch(i: int) -> None:
        slot = i % 2
        with torch.cuda.stream(side):
            side.wait_event(consumed[slot])
            c0, c1 = _event(), _event()
            c0.record(side)
            buffers[slot].copy_(batches[i], non_blocking=True)
            c1.record(side)
            copied[slot].record(side)
            events.append(("copy", c0, c1))

    prefetch(0)
    for i in range(len(batches)):
        if i + 1 < len(batches):
            prefetch(i + 1)
        slot = i % 2
        main.wait_event(copied[slot])
        k0, k1 = _event(), _event()
        k0.record(main)
        compute(buffers[slot], weight)
        k1.record(main)
        consumed[slot].record(main)
        events.append(("compute", k0, k1))
    end = _event()
    end.record(main)
    end.synchronize()
    torch.cuda.synchronize(device)
    return PipelineRun("overlapped", origin.elapsed_time(end), _cuda_spans(origin, events), CUDA_EVENT_RESOLUTION_MS)


@dataclass(frozen=True)
class OverlapResult:
    serial: PipelineRun
    overlapped: PipelineRun

    @property
    def speedup(self) -> float:
        return self.serial.total_ms / self.overlapped.total_ms


def compare(device: torch.device | str | None = None, sizes: OverlapSizes | None = None,
            *, compute_threads: int = 1) -> OverlapResult:
    """Best of ``repeats`` passes of each pipeline over the same batches, interleaved."""
    sizes = sizes or profile().pick(SIZES)
    device = torch.device(device or profile().device)
    batches, weight = make_workload(device, sizes)
    runs: dict[str, list[PipelineRun]] = {"serial": [], "overlapped": []}
    pipelines: dict[str, Callable[..., PipelineRun]] = {"serial": serial_pipeline, "overlapped": overlapped_pipeline}
    with torch.no_grad():
        for _ in range(sizes.repeats + 1):
            for mode, pipeline in pipelines.items():
                runs[mode].append(pipeline(batches, weight, compute_threads=compute_threads,
                                           link_bytes_per_s=sizes.link_bytes_per_s if device.type == "cpu" else None))
    best = {mode: min(found[1:], key=lambda r: r.total_ms) for mode, found in runs.items()}
    return OverlapResult(best["serial"], best["overlapped"])


def timeline_spans(result: OverlapResult) -> list[tuple[str, float, float, str]]:
    """Rows for :func:`labkit.plots.timeline`: copy and compute lanes of both pipelines."""
    rows = []
    for run, color in ((result.serial, BASELINE), (result.overlapped, FIX)):
        for label, start, duration in run.spans:
            rows.append((f"{run.mode}: {label}", start, duration, color))
    return rows
