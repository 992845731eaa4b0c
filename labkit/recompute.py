"""Activation checkpointing: recompute a block's activations in the backward pass instead of keeping them.

A training step keeps, from the forward pass until the backward pass uses them,
the tensors every layer saved (a Linear its input, a GELU its input). When the
batch is large and the layers small, those activations are most of the step's
memory, and ZeRO does nothing for them: it partitions model states only.
Checkpointing (Chen et al., arXiv 1604.06174; ``torch.utils.checkpoint``) keeps
only each block's input and runs the block's forward again during the backward:
memory goes down to the inputs plus one block's activations, and the step pays
one more forward pass. Fitting costs time.

The model here is a stack of MLP blocks (Linear d->4d, GELU, Linear 4d->d) run
on many tokens, so activations dominate. Both the memory and the time are
measured, and both have a model beside them:

- memory: every block saves its input (d), the GELU's input (4d) and the second
  Linear's input (4d), 36 bytes per token per unit of width in fp32;
  checkpointed, each block keeps its input and, during the backward, one block at
  a time holds its 36 again;
- time: a checkpointed step is a plain step plus one more forward, with the
  forward's time measured on its own.

On a GPU the peak comes from the caching allocator (``max_memory_allocated``);
on the CPU from the kernel's resident-set high-water mark in a fresh process
whose large allocations are each their own mapping (:func:`labkit.devices.peak_added_bytes`),
as :mod:`labkit.fused_loss` measures its peak.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from labkit import fresh_process
from labkit.devices import peak_added_bytes
from labkit.profiles import require_at_least

FP32_BYTES = 4
SAVED_WIDTHS_PER_BLOCK = 1 + 4 + 4
"""Widths of the tensors one block saves: the first Linear's input (d), the GELU's input (4d), the second Linear's input (4d)."""


@dataclass(frozen=True)
class RecomputeSize:
    """``blocks`` MLP blocks of width ``width`` (hidden 4 x width) on ``tokens`` tokens, timed ``repeats`` steps each."""

    blocks: int
    width: int
    tokens: int
    repeats: int

    def __post_init__(self) -> None:
        require_at_least(self, 1, "blocks", "width", "tokens", "repeats")

    @property
    def num_params(self) -> int:
        return self.blocks * (2 * 4 * self.width * self.width + 5 * self.width)


SIZES = {
    "ci": RecomputeSize(blocks=8, width=64, tokens=2048, repeats=5),
    "gpu": RecomputeSize(blocks=16, width=1024, tokens=16384, repeats=10),
    "multi-gpu": RecomputeSize(blocks=16, width=1024, tokens=16384, repeats=10),
}
KINDS = ("keep every activation", "checkpoint each block")


def make_model(size: RecomputeSize, device: str = "cpu") -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(size.width, 4 * size.width), nn.GELU(), nn.Linear(4 * size.width, size.width))
              for _ in range(size.blocks)]
    return nn.Sequential(*blocks).to(device)


def keep_all_forward(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """The baseline: every block's saved tensors stay alive until the backward pass."""
    return model(x)


def checkpointed_forward(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """Each block keeps only its input; its forward runs again when the backward reaches it."""
    for block in model:
        x = checkpoint(block, x, use_reentrant=False)
    return x


def forward_for(kind: str):
    """The forward function of ``kind`` (one of :data:`KINDS`), looked up when called so a patched one is used."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return keep_all_forward if kind == KINDS[0] else checkpointed_forward


def train_step(model: nn.Sequential, x: torch.Tensor, kind: str) -> None:
    for p in model.parameters():
        p.grad = None
    forward_for(kind)(model, x).float().pow(2).mean().backward()


def modelled_peak_bytes(size: RecomputeSize, kind: str) -> int:
    """Bytes a step adds at its peak: the activations alive at once, plus the parameters' gradients.

    Without checkpointing all blocks' saved tensors are alive when the backward
    starts; with it, every block's input plus one block's saved tensors (while
    its forward is recomputed). Gradients of the activations in flight and the
    kernels' temporaries are left out: they are what the measurement adds.
    """
    per_block = FP32_BYTES * size.tokens * size.width * SAVED_WIDTHS_PER_BLOCK
    grads = FP32_BYTES * size.num_params
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if kind == KINDS[0]:
        return size.blocks * per_block + grads
    return size.blocks * FP32_BYTES * size.tokens * size.width + per_block + grads


@dataclass(frozen=True)
class RecomputeResult:
    """Peak bytes added by one step and step times (each kind's fastest), plus one forward pass alone."""

    size: RecomputeSize
    peak_bytes: dict[str, int]
    step_ms: dict[str, float]
    forward_ms: float
    method: str
    timing: str

    def peak_ratio(self) -> float:
        return self.peak_bytes[KINDS[1]] / self.peak_bytes[KINDS[0]]

    def time_ratio(self) -> float:
        return self.step_ms[KINDS[1]] / self.step_ms[KINDS[0]]

    def modelled_time_ratio(self) -> float:
        """A checkpointed step is a plain step plus one forward pass, both measured."""
        return (self.step_ms[KINDS[0]] + self.forward_ms) / self.step_ms[KINDS[0]]

    def modelled_peak_ratio(self) -> float:
        return modelled_peak_bytes(self.size, KINDS[1]) / modelled_peak_bytes(self.size, KINDS[0])


def _peak_bytes_here(model: nn.Sequential, x: torch.Tensor, kind: str) -> int:
    """Peak memory one step adds in this process, after a warm-up step."""
    train_step(model, x, kind)
    for p in model.parameters():
        p.grad = None
    return peak_added_bytes(lambda: train_step(model, x, kind), x.device)


def _timed_ms(fn, device: torch.device) -> float:
    """Wall time on a GPU; on the CPU the process's CPU time, which other programs' load does not stretch.

    The CPU probe runs one thread, so its CPU time is the step's compute. Wall
    time was not usable on this shared 2-core box: at load 4-5 the fastest of three
    plain steps once came out at 451 ms against 200 ms quiet, and checkpointing
    looked faster than keeping every activation. With CPU time, the fastest of 3
    steps gave ratios of 1.18-1.39 over 9 runs at load 3-6, the fastest of 5 gave
    1.31-1.34 over 4 runs at load 3 (the model, 1.33-1.39): ci takes 5.
    """
    if device.type == "cuda":
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3
    start = time.process_time()
    fn()
    return (time.process_time() - start) * 1e3


def peaks_here(size: RecomputeSize, device: str = "cpu") -> dict[str, int]:
    """Peak bytes one step of each kind adds, each after a warm-up step."""
    model = make_model(size, device)
    x = torch.randn(size.tokens, size.width, generator=torch.Generator().manual_seed(1)).to(device)
    return {kind: _peak_bytes_here(model, x, kind) for kind in KINDS}


def times_here(size: RecomputeSize, device: str = "cpu") -> dict:
    """Step times with the kinds taking turns (load from elsewhere hits both alike), fastest kept; one forward
    pass alone, for the model."""
    model = make_model(size, device)
    x = torch.randn(size.tokens, size.width, generator=torch.Generator().manual_seed(1)).to(device)
    steps: dict[str, list[float]] = {kind: [] for kind in KINDS}
    forwards: list[float] = []
    for _ in range(size.repeats):
        for kind in KINDS:
            steps[kind].append(_timed_ms(lambda: train_step(model, x, kind), x.device))
        with torch.no_grad():
            forwards.append(_timed_ms(lambda: model(x), x.device))
    return {"step_ms": {k: min(v) for k, v in steps.items()}, "forward_ms": min(forwards),
            "spread": {k: statistics.median(v) / min(v) for k, v in steps.items()}}


PEAK_ALLOCATOR_ENV = fresh_process.PEAK_ALLOCATOR_ENV
"""The peak probe's allocator: every allocation over 64 KiB its own mapping, so the resident-set high-water mark
follows what is alive. Its steps also pay a page fault for every page they allocate, so the times are taken in
another process (:data:`TIMES_ALLOCATOR_ENV`): timed in the peak probe, a plain step took 66 ms against 38 ms,
and checkpointing cost 1.15-1.18x against a model of 1.29x in nine runs (1.12x once in a full test run), the
faults diluting the recomputation; with the default allocator, 1.22-1.28x against 1.28-1.30x in three."""


TIMES_ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
                       "OMP_NUM_THREADS": "1"}
"""The time probe's allocator: freed blocks stay in the heap and the next step reuses them, so a step's CPU time
is its compute, not page faults that come and go with glibc's sliding mmap threshold. With the default allocator
checkpointing measured 0.90-1.20x the model (1.147x-1.56x the plain step, failing both asserts once each in
ten quiet runs of Lab 4, and in 14 probes alone); with this one 0.99-1.02x in six probes alone."""


def measure(size: RecomputeSize, *, device: str = "cpu") -> RecomputeResult:
    """Both kinds measured; on the CPU in fresh single-threaded processes, one for the peaks and one for the
    times, each with its own allocator settings (:data:`PEAK_ALLOCATOR_ENV`, :data:`TIMES_ALLOCATOR_ENV`)."""
    peaks = measure_peaks(size, device=device)
    if device.startswith("cuda"):
        times = times_here(size, device)
        return RecomputeResult(size, peaks, times["step_ms"], times["forward_ms"], "torch.cuda.max_memory_allocated",
                               "wall clock")
    times = _probe(size, "times", TIMES_ALLOCATOR_ENV)
    return RecomputeResult(size, peaks, times["step_ms"], times["forward_ms"],
                           "resident-set high-water mark (VmHWM), fresh process",
                           "CPU time of one thread in a second fresh process")


def measure_peaks(size: RecomputeSize, *, device: str = "cpu") -> dict[str, int]:
    """Each kind's peak alone, as :func:`measure` takes it: what Exercise 4.2 checks, without the times'
    second fresh process (about half of a measurement on the CPU)."""
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"device must be 'cpu' or a CUDA device ('cuda', 'cuda:0', ...), got {device!r}")
    return peaks_here(size, device) if device.startswith("cuda") else _probe(size, "peaks", PEAK_ALLOCATOR_ENV)


def _probe(size: RecomputeSize, part: str, env: dict[str, str]):
    """``peaks_here`` or ``times_here`` in a fresh process with ``env`` added (each allocator env sets one thread)."""
    return fresh_process.run_module("labkit.recompute", json.dumps(asdict(size)), part, env=env,
                                    what=f"checkpointing probe ({part})")


def _main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    size, part = RecomputeSize(**json.loads(argv[0])), argv[1]
    print(json.dumps({"peaks": peaks_here, "times": times_here}[part](size)))


if __name__ == "__main__":
    # Run through the importable module, so a patched checkpointed_forward is the one measured.
    from labkit import recompute

    recompute._main(sys.argv[1:])
