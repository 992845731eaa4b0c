"""Bandwidth against working-set size: the memory hierarchy under the roofline's one memory roof.

The roofline has one memory roof, the bandwidth of the memory the data lives in.
Data that fits a cache is read from the cache, several times faster than from
DRAM (on a GPU: L2 against HBM). That is the physical reason tiling and fusion
pay: they keep a working set small enough to be reread from a cache, so the
intensity that matters is FLOPs per byte *from the slow memory*.

The sweep reads one array of ``working_set_bytes`` over and over in a single
kernel: ``x.expand(reps, n).sum()`` walks a stride-0 view, so the op streams
``reps x n`` elements while touching only ``n`` of them, and no per-call overhead
hides the small sizes. One thread on a CPU, so the sizes are one core's caches.
Cache sizes come from the kernel (sysfs) on Linux and from the device properties
on CUDA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from labkit.devices import synchronize, time_ms

CACHE_GAIN = 2.0
"""A working set inside a core's L2 must be read at least this many times faster than one far beyond the last
cache. Here (2-core EPYC VM, one thread, beside other busy processes) 64-67 GB/s against 8.6-9.4 GB/s, 7x."""

SYSFS_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


@dataclass(frozen=True)
class CachePoint:
    working_set_bytes: int
    bytes_per_s: float


@dataclass(frozen=True)
class CacheSweep:
    """Read bandwidth per working-set size, and this device's cache sizes (``{"L1d": bytes, ...}``)."""

    device: str
    points: list[CachePoint]
    caches: dict[str, int]

    def bandwidth_at(self, working_set_bytes: int) -> float:
        """The measured point nearest ``working_set_bytes`` (on a log scale)."""
        if not self.points or working_set_bytes <= 0:
            raise ValueError(f"need measured points and working_set_bytes > 0, got {working_set_bytes}")
        return min(self.points, key=lambda p: abs(math.log(p.working_set_bytes / working_set_bytes))).bytes_per_s

    @property
    def last_cache_bytes(self) -> int:
        return max(self.caches.values(), default=0)

    def in_cache(self) -> list[CachePoint]:
        """Points whose working set fits the core's second level (or, without one, half the last) cache."""
        limit = self.caches.get("L2", self.last_cache_bytes // 2)
        return [p for p in self.points if p.working_set_bytes <= limit]

    def beyond_caches(self) -> list[CachePoint]:
        """Points whose working set is at least four times the last cache: read from DRAM (or HBM)."""
        return [p for p in self.points if self.last_cache_bytes and p.working_set_bytes >= 4 * self.last_cache_bytes]

    def cache_gain(self) -> float:
        """Best in-cache bandwidth over the best beyond-the-caches bandwidth."""
        inside, outside = self.in_cache(), self.beyond_caches()
        if not inside or not outside:
            raise ValueError(f"the sweep needs points inside L2 and beyond 4x the last cache; caches {self.caches}")
        return max(p.bytes_per_s for p in inside) / max(p.bytes_per_s for p in outside)


def cache_sizes(device: torch.device | str = "cpu") -> dict[str, int]:
    """This device's data caches in bytes: ``L1d``, ``L2``, ``L3`` from sysfs, or a GPU's ``L2``; ``{}`` if unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
        return {"L2": int(size)} if size else {}
    found = {}
    for index in sorted(SYSFS_CACHES.glob("index*")):
        try:
            kind, level, size = ((index / name).read_text().strip() for name in ("type", "level", "size"))
        except OSError:
            continue
        if kind in ("Data", "Unified"):
            found[f"L{level}{'d' if kind == 'Data' else ''}"] = _parse_size(size)
    return found


def _parse_size(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def working_sets(caches: dict[str, int], *, smallest: int = 16 * 2**10, beyond: int = 8) -> list[int]:
    """Powers of two from ``smallest`` to ``beyond`` times the last cache (64 MiB without cache sizes)."""
    if smallest <= 0 or beyond < 1:
        raise ValueError(f"smallest must be > 0 bytes and beyond >= 1, got {smallest}, {beyond}")
    top = beyond * max(caches.values(), default=8 * 2**20)
    return [smallest * 2**i for i in range(int(math.log2(top / smallest)) + 1)]


def read_bytes_per_s(device: torch.device | str, working_set_bytes: int, *, read_bytes: int = 256 * 2**20,
                     repeats: int = 3) -> float:
    """Best bandwidth reading ``working_set_bytes`` of float32 again and again, ``read_bytes`` per call."""
    n = max(1, working_set_bytes // 4)
    x = torch.ones(n, device=device)
    reps = max(1, read_bytes // (4 * n))
    view = x.expand(reps, n)
    ms = min(time_ms(view.sum, device=device, warmup=1, repeats=repeats))
    return reps * n * 4 / (ms / 1e3)


def measure(device: torch.device | str = "cpu", sizes: list[int] | None = None) -> CacheSweep:
    """Read bandwidth at every working set, with one thread on a CPU (one core's caches), with a progress bar."""
    device = torch.device(device)
    caches = cache_sizes(device)
    sizes = sizes or working_sets(caches)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        points = [CachePoint(size, read_bytes_per_s(device, size))
                  for size in tqdm(sizes, desc="working-set sweep", leave=False)]
    finally:
        torch.set_num_threads(threads)
        synchronize(device)
    return CacheSweep(str(device), points, caches)


def size_label(size_bytes: int) -> str:
    """``16 KiB``, ``8 MiB``: a power-of-two size the way cache sizes are written."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size_bytes >= scale:
            return f"{size_bytes / scale:g} {unit}"
    return f"{size_bytes} B"


def hierarchy_sentences(sweep: CacheSweep) -> list[str]:
    """What the sweep showed, in its own numbers: cache against DRAM, and where the fall came."""
    from labkit.narrate import times

    inside = max(sweep.in_cache(), key=lambda p: p.bytes_per_s)
    outside = max(sweep.beyond_caches(), key=lambda p: p.bytes_per_s)
    last = max(sweep.caches, key=sweep.caches.get)
    level = min((name for name, size in sweep.caches.items() if size >= inside.working_set_bytes),
                key=sweep.caches.get, default=last)  # the smallest cache that holds the fastest working set
    return [f"A working set inside {level} was read at up to {inside.bytes_per_s / 1e9:.1f} GB/s "
            f"({size_label(inside.working_set_bytes)}), {times(inside.bytes_per_s, outside.bytes_per_s)} than one of "
            f"four times the last cache or more ({outside.bytes_per_s / 1e9:.1f} GB/s at "
            f"{size_label(outside.working_set_bytes)}; {last} holds {size_label(sweep.caches[last])}).",
            f"At {size_label(sweep.caches[last])} itself the read ran at "
            f"{sweep.bandwidth_at(sweep.caches[last]) / 1e9:.1f} GB/s."]


def plot(ax, sweep: CacheSweep) -> None:
    """Bandwidth against working set on log axes, each cache's size a dotted line."""
    from labkit.plots import BASELINE, FIX

    sizes = [p.working_set_bytes for p in sweep.points]
    ax.plot(sizes, [p.bytes_per_s / 1e9 for p in sweep.points], "o-", color=FIX, label="measured: read bandwidth")
    top = 1.1 * max(p.bytes_per_s for p in sweep.points) / 1e9
    for name, size in sweep.caches.items():
        ax.axvline(size, ls=":", color=BASELINE)
        ax.annotate(f"{name}\n{size_label(size)}", (size, top), ha="center", va="bottom", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes[::2], [size_label(size) for size in sizes[::2]], fontsize=8)
    ax.set_xlabel("working set (bytes read again and again)")
    ax.set_ylabel("read bandwidth (GB/s)")
    ax.set_ylim(0, 1.3 * top)
    ax.legend(fontsize=8, loc="lower left")
