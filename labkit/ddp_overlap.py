"""How DDP hides the gradient all-reduce behind the backward pass: buckets.

Li et al.'s DDP paper (VLDB 2020) is about one idea: do not wait for the whole
backward pass before communicating. DDP groups the gradients into *buckets* in the
order backward produces them (last layer first) and all-reduces each bucket as soon
as all of its gradients exist, while autograd goes on computing the earlier layers.
Only what is still on the link when backward ends is *exposed*: it adds to the step.

This module measures that on two real ranks over a real shaped link: the same model
with one bucket (nothing can start before backward ends), with DDP's default buckets
(25 MiB, and a first bucket of 1 MiB) and with small buckets (:data:`SMALL_BUCKET_BYTES`).
Each variant's *exposed communication* is measured inside every step: the wait from
the moment the last gradient on any rank was produced to the moment the last rank's
``backward()`` returned (DDP returns only once every bucket's all-reduce is done). The model
(:func:`labkit.ddp_overlap_model.modelled_exposed_s`) sends the buckets one after
another over the link as backward releases them. One profiled step per layout shows
the backward ops and gloo's all-reduces on a timeline.

The ranks are gloo processes on the CPU on every machine: the fabric's shaped links
carry gloo's TCP (NCCL's device links would bypass them), and the host clocks used
here time CPU work exactly. The overlap is real: backward runs on the rank's own
thread while gloo's worker thread mostly waits on its socket and the kernel paces
the link. Emulated links (no fabric) sleep in a callback instead, so their overlap
follows the model and is not evidence for it: the notebook asserts only on real links.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from labkit.collectives import CommCounter, register_counting_hook
from labkit.ddp_overlap_model import (NO_COMMUNICATION, ONE_BUCKET_BYTES, SMALL_BUCKET_BYTES, VARIANTS, OverlapResult,
                                      OverlapSizes)
from labkit.gradsync_links import LinkMode, emulated_link, launch_over_links, link_mode, set_link_rate
from labkit.gradsync_workload import make_model, param_bytes

# Batch 1024 makes backward (about 50-55 ms here, alone) as long as most of the 1 Gbit/s all-reduce (67 ms
# modelled), so small buckets can hide most of it: their wait came to 0.14-0.17 of one bucket's (modelled
# 0.31-0.39) in ten runs of Lab 5. With batch 256 backward took 13-15 ms alone, the model itself left small buckets
# 0.81-0.84 of one bucket's wait, measured 0.64-0.71, and Lab 5 failed EXPOSED_SHARE_LIMIT (0.7) once in ten
# quiet runs; it had passed on a busy box, where backward ran slower.
SIZES = {
    "ci": OverlapSizes(hidden=512, layers=8, batch=1024, timed_steps=2, rounds=2),
    "gpu": OverlapSizes(hidden=512, layers=8, batch=1024, timed_steps=3, rounds=2),
    "multi-gpu": OverlapSizes(hidden=1024, layers=8, batch=256, timed_steps=3, rounds=2),
}


def bucket_cap_mb(variant: str) -> float | None:
    """DDP's ``bucket_cap_mb`` for ``variant`` (``None``: DDP's default)."""
    caps = {"one bucket": ONE_BUCKET_BYTES / 2**20, "DDP default": None, "small buckets": SMALL_BUCKET_BYTES / 2**20}
    if variant not in caps:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    return caps[variant]


def wrap_ddp(model: nn.Module, variant: str) -> nn.parallel.DistributedDataParallel:
    """``model`` under DDP with ``variant``'s buckets."""
    return nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb(variant))


MARKS = ("start", "backward_start", "last_gradient", "backward_end", "end")
"""The clock readings (``perf_counter``, one monotonic clock for every process on the machine) of a timed step."""


def fastest_of_steps(marks: torch.Tensor) -> dict[str, float]:
    """The fastest step, backward and wait of ``marks`` (``[ranks, steps, len(MARKS)]``, every rank's steps).

    Per step: the step and backward take as long as on the slowest rank, and the wait
    runs from the last gradient produced on *any* rank to the moment the last rank's
    ``backward()`` returned. Measured on one rank instead, a rank that finished its
    backward early would count its wait for the other rank's backward (a straggler,
    not the link) as communication. Then the fastest step of each: contention on a
    shared machine only ever adds time.
    """
    if marks.dim() != 3 or marks.shape[2] != len(MARKS) or marks.shape[1] < 1:
        raise ValueError(f"marks must be [ranks, steps >= 1, {len(MARKS)}], got {list(marks.shape)}")
    at = {name: marks[:, :, i] for i, name in enumerate(MARKS)}
    step = (at["end"] - at["start"]).max(dim=0).values
    backward = (at["last_gradient"] - at["backward_start"]).max(dim=0).values
    wait = at["backward_end"].max(dim=0).values - at["last_gradient"].max(dim=0).values
    return {"step_s": step.min().item(), "backward_s": backward.min().item(), "tail_s": max(wait.min().item(), 0.0)}


def _last_gradient_clock(model: nn.Module) -> list[float]:
    """A list that each step's gradients append their ready time to (``perf_counter``): its max is backward's end."""
    ready: list[float] = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda _p: ready.append(time.perf_counter()))
    return ready


def _timed_steps(ddp: nn.parallel.DistributedDataParallel, optimizer: torch.optim.Optimizer, x: torch.Tensor,
                 y: torch.Tensor, ready: list[float], steps: int, sync: bool = True) -> list[list[float]]:
    """One warm-up and ``steps`` timed training steps; each timed step's clock readings (:data:`MARKS`).

    The wait is measured inside each step: from the moment backward produced its
    last gradient to the moment ``backward()`` returned, which DDP delays until
    every bucket's all-reduce has finished; :func:`fastest_of_steps` takes it
    across the ranks.
    """
    marks = []
    for i in range(steps + 1):
        optimizer.zero_grad(set_to_none=False)
        start = time.perf_counter()
        with (contextlib.nullcontext() if sync else ddp.no_sync()):
            loss = nn.functional.mse_loss(ddp(x), y)
            ready.clear()
            backward_start = time.perf_counter()
            loss.backward()
            backward_end = time.perf_counter()
        optimizer.step()
        if i:
            marks.append([start, backward_start, max(ready), backward_end, time.perf_counter()])
    return marks


class HandBuckets:
    """All-reduce hand-made buckets while backward runs, launched in bucket order as DDP's reducer launches its own.

    Exercise 5.2 runs a learner's buckets through this, so their *order* is what is
    tested: a bucket is launched once every gradient in it exists and every earlier
    bucket has been launched. A first bucket that holds the first layer's gradients,
    which backward produces last, holds every other bucket back until backward ends.
    """

    def __init__(self, params: Sequence[nn.Parameter], buckets: Sequence[Sequence[int]]):
        self.params, self.buckets = list(params), [list(b) for b in buckets]
        self.ready: set[int] = set()
        self.launched: list[tuple[list[int], torch.Tensor, Any]] = []
        self.last_gradient_s = 0.0
        for index, param in enumerate(self.params):
            param.register_post_accumulate_grad_hook(lambda _p, index=index: self._gradient_ready(index))

    def _gradient_ready(self, index: int) -> None:
        self.ready.add(index)
        self.last_gradient_s = time.perf_counter()
        while len(self.launched) < len(self.buckets) and self.ready.issuperset(self.buckets[len(self.launched)]):
            bucket = self.buckets[len(self.launched)]
            flat = torch.cat([self.params[i].grad.reshape(-1) for i in bucket])
            self.launched.append((bucket, flat, dist.all_reduce(flat, async_op=True)))

    def finish(self) -> None:
        """Wait for every bucket and write the averaged gradients back."""
        for _, _, work in self.launched:
            work.wait()
        for bucket, flat, _ in self.launched:
            for i, piece in zip(bucket, flat.split([self.params[i].numel() for i in bucket])):
                self.params[i].grad.copy_(piece.view_as(self.params[i].grad)).div_(dist.get_world_size())
        if len(self.launched) != len(self.buckets):
            raise RuntimeError(f"{len(self.buckets) - len(self.launched)} bucket(s) never became ready")
        self.ready.clear()
        self.launched.clear()


def hand_buckets_rank(buckets: Sequence[Sequence[int]], hidden: int, layers: int, batch: int, steps: int,
                      rate_gbit: float, links: dict[str, Any] | None = None) -> dict[str, float]:
    """Rank function: the fastest wait after backward with one bucket and with ``buckets`` (:func:`fastest_of_steps`)."""
    if links is not None and dist.get_rank() == 0:
        set_link_rate(links, rate_gbit)
    x = torch.randn(batch, hidden, generator=torch.Generator().manual_seed(dist.get_rank()))
    waits = {}
    for name in ("one bucket", "yours"):
        model = make_model(hidden, layers)
        params = list(model.parameters())
        hand = HandBuckets(params, [list(range(len(params)))] if name == "one bucket" else buckets)
        marks = []
        for step in range(steps + 1):
            model.zero_grad(set_to_none=False)
            dist.barrier()
            start = time.perf_counter()
            nn.functional.mse_loss(model(x), x.flip(1)).backward()
            hand.finish()
            done = time.perf_counter()
            if step:
                marks.append([start, start, hand.last_gradient_s, done, done])
        everyone = [torch.zeros(steps, len(MARKS), dtype=torch.float64) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, torch.tensor(marks, dtype=torch.float64))
        waits[name] = fastest_of_steps(torch.stack(everyone))["tail_s"]
    return waits


def _timeline(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> dict[str, list]:
    """One profiled step: the backward ops and gloo's all-reduces, in ms from the start of backward."""
    from torch.profiler import ProfilerActivity, profile, record_function

    optimizer.zero_grad(set_to_none=False)
    loss = nn.functional.mse_loss(model(x), y)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("labkit:backward"):
            loss.backward()
    optimizer.step()
    events = prof.events()
    start = min(e.time_range.start for e in events if e.name == "labkit:backward")
    spans: dict[str, list] = {"backward": [], "all_reduce": []}
    for e in events:
        kind = ("backward" if e.name.startswith("autograd::engine::evaluate_function:")
                else "all_reduce" if e.name.startswith("gloo:all_reduce") else None)
        if kind:
            spans[kind].append(((e.time_range.start - start) / 1e3, (e.time_range.end - start) / 1e3))
    return {kind: sorted(s) for kind, s in spans.items()}


def overlap_rank(hidden: int, layers: int, batch: int, timed_steps: int, rounds: int, rate_gbit: float,
                 links: dict[str, Any] | None = None) -> dict[str, Any]:
    """Rank function: per round, no communication, then each bucket layout; then one profiled step of each.

    Returns the fastest step, backward and wait per point over both ranks
    (:func:`fastest_of_steps`), the bucket sizes DDP used (bytes, in the order it
    all-reduced them) and rank 0's timelines.
    """
    from labkit.launcher import rank_device

    rank, device = dist.get_rank(), rank_device()
    if links is not None and rank == 0:
        set_link_rate(links, rate_gbit)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, hidden, generator=gen).to(device)
    y = x.flip(1)
    models, optimizers, counters, clocks = {}, {}, {}, {}
    for variant in VARIANTS:
        models[variant] = wrap_ddp(make_model(hidden, layers).to(device), variant)
        counters[variant] = CommCounter(link=None if links is not None else emulated_link(rate_gbit))
        register_counting_hook(models[variant], counters[variant])
        optimizers[variant] = torch.optim.SGD(models[variant].parameters(), lr=1e-3)
        clocks[variant] = _last_gradient_clock(models[variant].module)
    marks: dict[str, list[list[float]]] = {name: [] for name in (NO_COMMUNICATION, *VARIANTS)}
    for _ in range(rounds):
        for name in marks:
            variant = VARIANTS[0] if name == NO_COMMUNICATION else name
            dist.barrier()
            marks[name] += _timed_steps(models[variant], optimizers[variant], x, y, clocks[variant], timed_steps,
                                        sync=name != NO_COMMUNICATION)
    timed = {}
    for name, mine in marks.items():
        everyone = [torch.zeros(len(mine), len(MARKS), dtype=torch.float64) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, torch.tensor(mine, dtype=torch.float64))
        timed[name] = fastest_of_steps(torch.stack(everyone))
    buckets, timelines = {}, {}
    for variant in VARIANTS:
        counters[variant].reset()
        dist.barrier()
        timelines[variant] = _timeline(models[variant], optimizers[variant], x, y)
        buckets[variant] = [c.message_bytes for c in counters[variant].records]
    return {"timed": timed, "bucket_bytes": buckets, "timelines": timelines,
            "gradient_bytes": param_bytes(models[VARIANTS[0]].module)}


def run_overlap(world_size: int = 2, sizes: OverlapSizes | None = None, mode: LinkMode | None = None,
                timeout_s: float = 300.0) -> OverlapResult:
    """One launch of gloo ranks, one per node, over a link at ``sizes.rate_gbit`` (real where possible)."""
    from labkit.profiles import profile

    if world_size < 2:
        raise ValueError(f"world_size must be >= 2 for an all-reduce over a link, got {world_size}")
    prof = profile()
    chosen = sizes or prof.pick(SIZES)
    backend = "gloo"
    mode = mode or link_mode(backend)
    kwargs = dataclasses.asdict(chosen)
    ranks = launch_over_links(overlap_rank, world_size, chosen.rate_gbit, mode, backend=backend, timeout_s=timeout_s,
                              **kwargs)
    got = ranks[0]
    return OverlapResult(link_mode=mode, sizes=chosen, world_size=world_size, timed=got["timed"],
                         bucket_bytes=got["bucket_bytes"], timelines=got["timelines"],
                         gradient_bytes=got["gradient_bytes"])


