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
the moment backward produced its last gradient to the moment ``backward()`` returned
(DDP returns only once every bucket's all-reduce is done). The model
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
import math
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from labkit.collectives import CommCounter, register_counting_hook
from labkit.ddp_overlap_model import (NO_COMMUNICATION, ONE_BUCKET_BYTES, SMALL_BUCKET_BYTES, VARIANTS, OverlapResult,
                                      OverlapSizes)
from labkit.gradsync_links import LinkMode, emulated_link, link_mode, set_link_rate
from labkit.gradsync_model import two_node_topology
from labkit.gradsync_workload import make_model, param_bytes

SIZES = {
    "ci": OverlapSizes(hidden=512, layers=8, batch=256, timed_steps=2, rounds=2),
    "gpu": OverlapSizes(hidden=512, layers=8, batch=256, timed_steps=3, rounds=2),
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


@dataclasses.dataclass
class _Fastest:
    """The fastest step, backward and tail seen so far: contention on a shared machine only ever adds time."""

    step_s: float = math.inf
    backward_s: float = math.inf
    tail_s: float = math.inf

    def keep(self, step_s: float, backward_s: float, tail_s: float) -> None:
        self.step_s, self.backward_s = min(self.step_s, step_s), min(self.backward_s, backward_s)
        self.tail_s = min(self.tail_s, tail_s)


def _last_gradient_clock(model: nn.Module) -> list[float]:
    """A list that each step's gradients append their ready time to (``perf_counter``): its max is backward's end."""
    ready: list[float] = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda _p: ready.append(time.perf_counter()))
    return ready


def _timed_steps(ddp: nn.parallel.DistributedDataParallel, optimizer: torch.optim.Optimizer, x: torch.Tensor,
                 y: torch.Tensor, ready: list[float], steps: int, fastest: _Fastest, sync: bool = True) -> None:
    """One warm-up and ``steps`` timed training steps; keeps the fastest step, backward compute and tail.

    The tail is measured inside each step: from the moment backward produced its
    last gradient to the moment ``backward()`` returned, which DDP delays until
    every bucket's all-reduce has finished. So it is the communication the step
    waited for, whatever other programs did to the step's compute.
    """
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
            fastest.keep(time.perf_counter() - start, max(ready) - backward_start, backward_end - max(ready))


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

    def finish(self) -> float:
        """Wait for every bucket, write the averaged gradients back; returns the wait after the last gradient."""
        for _, _, work in self.launched:
            work.wait()
        wait_s = time.perf_counter() - self.last_gradient_s
        for bucket, flat, _ in self.launched:
            for i, piece in zip(bucket, flat.split([self.params[i].numel() for i in bucket])):
                self.params[i].grad.copy_(piece.view_as(self.params[i].grad)).div_(dist.get_world_size())
        if len(self.launched) != len(self.buckets):
            raise RuntimeError(f"{len(self.buckets) - len(self.launched)} bucket(s) never became ready")
        self.ready.clear()
        self.launched.clear()
        return wait_s


def hand_buckets_rank(buckets: Sequence[Sequence[int]], hidden: int, layers: int, batch: int, steps: int,
                      rate_gbit: float, links: dict[str, Any] | None = None) -> dict[str, float]:
    """Rank function: the slowest rank's fastest wait after backward with one bucket and with ``buckets``."""
    if links is not None and dist.get_rank() == 0:
        set_link_rate(links, rate_gbit)
    x = torch.randn(batch, hidden, generator=torch.Generator().manual_seed(dist.get_rank()))
    waits = {}
    for name in ("one bucket", "yours"):
        model = make_model(hidden, layers)
        params = list(model.parameters())
        hand = HandBuckets(params, [list(range(len(params)))] if name == "one bucket" else buckets)
        wait_s = []
        for _ in range(steps + 1):
            model.zero_grad(set_to_none=False)
            dist.barrier()
            nn.functional.mse_loss(model(x), x.flip(1)).backward()
            wait_s.append(hand.finish())
        slowest = torch.tensor([min(wait_s[1:])], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        waits[name] = slowest.item()
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

    Returns the slowest rank's fastest step per point, rank 0's backward time with no
    communication, the bucket sizes DDP used (bytes, in the order it all-reduced
    them) and rank 0's timelines.
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
    fastest = {name: _Fastest() for name in (NO_COMMUNICATION, *VARIANTS)}
    for _ in range(rounds):
        for name in fastest:
            variant = VARIANTS[0] if name == NO_COMMUNICATION else name
            dist.barrier()
            _timed_steps(models[variant], optimizers[variant], x, y, clocks[variant], timed_steps, fastest[name],
                         sync=name != NO_COMMUNICATION)
    # the slowest rank's fastest of each: the step waits for the slower rank
    slowest = torch.tensor([[f.step_s, f.backward_s, f.tail_s] for f in fastest.values()], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    timed = {name: dict(zip(("step_s", "backward_s", "tail_s"), row)) for name, row in zip(fastest, slowest.tolist())}
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
    from labkit.launcher import launch
    from labkit.profiles import profile

    if world_size < 2:
        raise ValueError(f"world_size must be >= 2 for an all-reduce over a link, got {world_size}")
    prof = profile()
    chosen = sizes or prof.pick(SIZES)
    backend = "gloo"
    mode = mode or link_mode(backend)
    kwargs = dataclasses.asdict(chosen)
    if mode.mode == "namespaces":
        from labkit import fabric

        with fabric.Fabric(two_node_topology(world_size, chosen.rate_gbit)) as fab:
            ranks = launch(overlap_rank, world_size, backend=backend, timeout_s=timeout_s, fabric=fab,
                           links=fab.links, **kwargs)
    else:
        ranks = launch(overlap_rank, world_size, backend=backend, timeout_s=timeout_s, **kwargs)
    got = ranks[0]
    return OverlapResult(link_mode=mode, sizes=chosen, world_size=world_size, timed=got["timed"],
                         bucket_bytes=got["bucket_bytes"], timelines=got["timelines"],
                         gradient_bytes=got["gradient_bytes"])


