"""Devices and honest timing.

GPU work is asynchronous: ``time.perf_counter`` around a CUDA call measures the
launch, not the kernel. Every timer here synchronises the device (or uses CUDA
events) so the same code reports true times on a CPU and on a GPU. Each
measurement also records the machine's load average, because a shared box makes
any single number suspect.
"""

from __future__ import annotations

import os
import platform
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping

import torch


def pick_device(prefer: str | None = None) -> torch.device:
    """``prefer`` if available, else CUDA if present, else the CPU (never fails)."""
    if prefer is not None:
        if prefer.startswith("cuda") and not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device(prefer)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def synchronize(device: torch.device | str) -> None:
    """Wait for queued work on ``device``; a no-op on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def load_average() -> float:
    """One-minute load average; over the core count means the timings are contended."""
    return os.getloadavg()[0]


def others_busy_cores(window_s: float = 1.0) -> float | None:
    """Cores other programs keep busy: the machine's busy time while this process sleeps ``window_s``.

    The load average lags a minute behind and counts waiting processes too; this
    reads ``/proc/stat`` before and after a short sleep, so it says how many of
    the machine's cores were taken right now, by anything but this (sleeping)
    process. None where ``/proc/stat`` is missing (not Linux).
    """
    if window_s <= 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")

    def busy_and_total() -> tuple[int, int]:
        with open("/proc/stat") as stat:
            ticks = [int(field) for field in stat.readline().split()[1:]]
        idle = ticks[3] + ticks[4]   # idle, iowait
        return sum(ticks) - idle, sum(ticks)

    try:
        busy_before, total_before = busy_and_total()
        time.sleep(window_s)
        busy_after, total_after = busy_and_total()
    except (OSError, ValueError, IndexError):
        return None
    if total_after <= total_before:
        return 0.0
    return (busy_after - busy_before) / (total_after - total_before) * (os.cpu_count() or 1)


@dataclass
class Stopwatch:
    """``with Stopwatch(device) as sw: ...`` then ``sw.ms``; synchronises on entry and exit."""

    device: torch.device | str = "cpu"
    ms: float = 0.0
    load_avg: float = 0.0
    _start: float = field(default=0.0, repr=False)

    def __enter__(self) -> "Stopwatch":
        synchronize(self.device)
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        synchronize(self.device)
        self.ms = (time.perf_counter() - self._start) * 1e3
        self.load_avg = load_average()


def interleaved_best_ms(
    fns: Mapping[str, Callable[[], object]],
    *,
    device: torch.device | str = "cpu",
    warmup: int = 1,
    repeats: int = 9,
) -> dict[str, float]:
    """Best milliseconds of each function, timed in alternating rounds.

    Comparing two ways of doing the same work on a shared machine: timing one
    block of repeats after the other lets the neighbours' load change between
    the blocks, and the ratio swings with it. Alternating puts both under the
    same conditions, and the minimum of each keeps the least-disturbed call.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            best[name] = min(best[name], time_ms(fn, device=device, warmup=0, repeats=1)[0])
    return best


def time_ms(
    fn: Callable[[], object],
    *,
    device: torch.device | str = "cpu",
    warmup: int = 1,
    repeats: int = 5,
) -> list[float]:
    """Milliseconds per call of ``fn`` over ``repeats`` calls after ``warmup``.

    On CUDA the interval is measured with events on the current stream, which
    excludes Python overhead between calls but includes every queued kernel.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    for _ in range(warmup):
        fn()
    device = torch.device(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            with Stopwatch(device) as sw:
                fn()
            times.append(sw.ms)
    return times


def describe_machine() -> dict[str, object]:
    """A short description to print beside results: numbers mean little without it."""
    info: dict[str, object] = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "load_avg": round(load_average(), 2),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpus"] = torch.cuda.device_count()
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
    return info


REFERENCE_GPU_BYTES = 80 * 2**30
"""80 GiB: an H100 80GB or A100 80GB, the GPUs large models are trained on today."""


def accelerator_memory_bytes() -> tuple[int, str]:
    """Memory of GPU 0 in bytes, and a line saying where the figure comes from.

    On a GPU, the device's own total (``torch.cuda.get_device_properties``). On a
    CPU-only machine there is no accelerator memory to read, and host RAM would
    answer a different question, so the figure is :data:`REFERENCE_GPU_BYTES`, and
    the line says so.
    """
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory, f"{props.name}: {props.total_memory / 2**30:.1f} GiB, read from the device"
    return REFERENCE_GPU_BYTES, (f"no GPU here: a reference {REFERENCE_GPU_BYTES / 2**30:.0f} GiB device "
                                 "(an H100 or A100 80GB, today's usual training GPU)")


def cpu_ms_per_item(runs: Mapping[str, Callable[[], object]], items: int, *, repeats: int = 2) -> dict[str, float]:
    """CPU milliseconds per item of each run, best of ``repeats``, the runs taking turns.

    CPU time of the whole process (every thread it started), not wall time: a busy
    shared machine moves it less. Taking turns lets a busy spell hit every run alike.
    """
    if items < 1 or repeats < 1:
        raise ValueError(f"items and repeats must be >= 1, got {items} and {repeats}")
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.process_time()
            run()
            best[name] = min(best[name], time.process_time() - start)
    return {name: 1e3 * seconds / items for name, seconds in best.items()}


def loader_workers(cap: int = 16) -> int:
    """Loader processes to start: one per core this process may run on, at most ``cap``.

    ``os.cpu_count()`` counts the machine, not the cores a container or taskset
    grants; on a large GPU node it would also start a hundred or more workers, each
    with its own copy of the loader's state.
    """
    if cap < 1:
        raise ValueError(f"cap must be >= 1, got {cap}")
    return max(1, min(cap, len(os.sched_getaffinity(0))))


@contextmanager
def host_threads(count: int | None) -> Iterator[None]:
    """Limit this process's intra-op threads for the duration of a measurement.

    When loader workers already hold the cores (a stand-in accelerator, a Daft
    pipeline), the training loop's own OpenMP threads spin against them for the
    same cores: a 1 ms batch gather can take 50 ms on a loaded 2-core box.
    ``None`` leaves the setting alone.
    """
    if count is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class PeakRss:
    """Peak resident memory this process added during a ``with`` block, in bytes (``added_bytes``).

    Read from the kernel's own high-water mark (``VmHWM``, reset by writing 5 to
    ``/proc/self/clear_refs``): exact, no sampling thread that could miss a spike.
    Linux only; the host-side counterpart of ``torch.cuda.max_memory_allocated``.

    Resident memory grows only when the allocator asks the kernel for pages, so
    memory that earlier code freed but ``malloc`` kept is reused inside the block
    without raising the mark. A caller that must count every byte a block takes
    calls :func:`return_freed_heap` first (after a test that built and dropped
    Python lists of a few MB, 18.9 MB of decoded images read as 12.5 MB without it).
    """

    def __enter__(self) -> PeakRss:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        self.start_bytes = _status_bytes("VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        self.added_bytes = max(0, _status_bytes("VmHWM") - self.start_bytes)


def return_freed_heap() -> None:
    """Ask glibc to give the heap's free pages back to the kernel (no-op where there is no ``malloc_trim``)."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)   # the process's own symbols: libc's, without a library search
    except (OSError, AttributeError):
        pass


def peak_added_bytes(run: Callable[[], object], device: torch.device | str) -> int:
    """Peak memory ``run()`` adds above what was held when it started, on ``device``.

    A GPU reads the caching allocator's peak (``max_memory_allocated``). The CPU has
    no allocator counter: it reads the kernel's resident-set mark (:class:`PeakRss`)
    after :func:`return_freed_heap`, so memory that earlier work freed is not reused
    unseen. Callers run a warm-up first and, on the CPU, give large allocations their
    own mappings (glibc's mmap threshold), so that a freed tensor leaves the mark.
    """
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        run()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    return_freed_heap()
    with PeakRss() as peak:
        run()
    return peak.added_bytes


def _status_bytes(field_name: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field_name} not in /proc/self/status")
