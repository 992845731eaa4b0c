"""What each ZeRO stage sends over the network per step: bytes on a shaped link, and the time they cost.

ZeRO's stages 1-2 keep data parallelism's communication volume (a reduce-scatter of
the gradients and an all-gather of the updated parameters add up to one
all-reduce); stage 3 gathers the parameters twice, once for the forward and once
for the backward, so it sends 1.5x as much (ZeRO paper, arXiv 1910.02054, section
7). The probe's engines (:mod:`labkit.zero_probe`) run on the two nodes of a
:class:`labkit.fabric.Fabric`, one rank each, so every byte a rank sends crosses
its node's tbf-shaped link, and the kernel counts it. Nothing here counts bytes
itself or sleeps: the link rate is a real shaper's, the bytes are the link's
counters (as in Labs 5 and 6).

The ring model is the paper's. The engine's model is what DeepSpeed issues
(:data:`DEEPSPEED_OPS`, checked against the calls :func:`counted_collectives`
counts) priced at what this backend was measured to send for one call of each,
on the same links. Both differ from the paper here: DeepSpeed reduces each
gradient bucket of stages 1-2 with an all-reduce (``use_multi_rank_bucket_allreduce``,
on by default), and gloo's reduce-scatter, which stage 3 uses, sent as many bytes
as an all-reduce of the same tensor (16.0 MB per rank for a 16 MB tensor on 2
ranks, where a ring sends 8.0).

Then the links are slowed, and each stage's step time is set beside the model:
the step on a fast link plus the bytes a rank sent over the slow link's rate.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from labkit import zero
from labkit.collectives import ring_bytes_per_rank
from labkit.topology import GBIT, Topology

FAST_GBIT = 10.0
"""The links' rate while the probe weighs and times its engines: faster than two CPU ranks can send."""

RING_OPS = {
    0: ("all_reduce",),
    1: ("reduce_scatter", "all_gather"),
    2: ("reduce_scatter", "all_gather"),
    3: ("all_gather", "all_gather", "reduce_scatter"),
}
"""The collectives of one step over the whole model, by stage (ZeRO paper, section 7)."""

DEEPSPEED_OPS = {
    0: ("all_reduce",),
    1: ("all_reduce", "all_gather"),
    2: ("all_reduce", "all_gather"),
    3: ("all_gather", "all_gather", "reduce_scatter"),
}
"""What DeepSpeed's engines issue over the whole model per step, by stage (counted here with deepspeed 0.19)."""


@dataclass(frozen=True)
class TrafficSize:
    """The link rate ``slow_gbit`` that makes communication the larger part of a step, timed ``timed_steps`` steps."""

    slow_gbit: float
    timed_steps: int

    def __post_init__(self) -> None:
        if not self.slow_gbit > 0:
            raise ValueError(f"slow_gbit must be > 0, got {self.slow_gbit}")
        if self.timed_steps < 1:
            raise ValueError(f"timed_steps must be >= 1, got {self.timed_steps}")


SIZES = {
    "ci": TrafficSize(slow_gbit=0.1, timed_steps=2),
    "gpu": TrafficSize(slow_gbit=0.1, timed_steps=3),
    "multi-gpu": TrafficSize(slow_gbit=0.1, timed_steps=3),
}


@dataclass(frozen=True)
class StageTraffic:
    """One stage on one rank: the payload its node's link carried up in one step, and step times."""

    stage: int
    sent_bytes: int
    wire_bytes: int
    slow_step_ms: float
    sent_per_message_byte: dict[str, float]
    """What the backend sent per message byte for each collective of :data:`RING_OPS`, measured on the links."""


def modelled_bytes_per_rank(num_params: int, stage: int, ranks: int, bytes_per_elem: int,
                            sent_per_message_byte: dict[str, float] | None = None) -> float:
    """Bytes one rank sends per step: the stage's collectives over the whole model.

    Without ``sent_per_message_byte``, the paper's collectives (:data:`RING_OPS`) priced
    by the ring algorithm (2(N-1)/N of the model at stages 0-2, 3(N-1)/N at stage 3);
    with it, DeepSpeed's (:data:`DEEPSPEED_OPS`) at what a backend was measured to send.
    """
    zero.model_state_bytes(num_params, stage, ranks)  # refuses a bad stage, rank count or size
    if bytes_per_elem < 1:
        raise ValueError(f"bytes_per_elem must be >= 1, got {bytes_per_elem}")
    message = num_params * bytes_per_elem
    if sent_per_message_byte is None:
        return sum(ring_bytes_per_rank(op, message, ranks) for op in RING_OPS[stage])
    return sum(sent_per_message_byte[op] * message for op in DEEPSPEED_OPS[stage])


def link_ms(sent_bytes: float, gbit: float) -> float:
    """The time ``sent_bytes`` take at ``gbit``: no step that sends them can be shorter."""
    if not gbit > 0:
        raise ValueError(f"gbit must be > 0, got {gbit}")
    return sent_bytes / (gbit * GBIT) * 1e3


def modelled_step_ms_range(fast_step_ms: float, sent_bytes: float, gbit: float) -> tuple[float, float]:
    """A step on a slow link, between full overlap of compute and sending (the longer of the two) and none (their sum).

    Stage 3 prefetches the next layers' parameters while the current one computes,
    and gloo sends on its own threads, so some overlap is real.
    """
    sending = link_ms(sent_bytes, gbit)
    return max(fast_step_ms, sending), fast_step_ms + sending


COUNTED_OPS = ("all_reduce", "all_gather_into_tensor", "all_gather", "reduce_scatter_tensor", "reduce_scatter",
               "reduce", "broadcast", "all_reduce_coalesced", "allgather_fn")


class CollectiveCalls:
    """Calls of each collective, by the phase of the step the caller says it is in."""

    def __init__(self) -> None:
        self.phase = "forward"
        self.calls: dict[str, dict[str, int]] = {}

    def count(self, op: str) -> None:
        by_op = self.calls.setdefault(self.phase, {})
        by_op[op] = by_op.get(op, 0) + 1


@contextlib.contextmanager
def counted_collectives() -> Iterator[CollectiveCalls]:
    """Count the collectives a DeepSpeed engine issues, at DeepSpeed's communication backend.

    DeepSpeed's engines call ``deepspeed.comm``, which hands every call to one
    backend object; counting there sees the calls however DeepSpeed bound the
    torch functions when it started (a wrapper on ``torch.distributed`` set later
    misses stages 1-2's all-gathers, :mod:`labkit.gradsync_deepspeed`).
    """
    from deepspeed.comm import comm

    backend, counter = comm.cdb, CollectiveCalls()
    wrapped = []
    for op in COUNTED_OPS:
        original = getattr(backend, op, None)
        if original is None or op in vars(backend):
            continue

        def counting(*args, _op=op, _original=original, **kwargs):
            counter.count(_op)
            return _original(*args, **kwargs)

        setattr(backend, op, counting)
        wrapped.append(op)
    try:
        yield counter
    finally:
        for op in wrapped:
            delattr(backend, op)


def topology(ranks: int) -> Topology:
    """One rank per node, so each rank's bytes to the other crosses its own node's link."""
    return Topology(nodes=ranks, ranks_per_node=1, inter_node_bytes_per_s=FAST_GBIT * GBIT)


def _set_rate(fab: Any, gbit: float) -> None:
    import torch.distributed as dist

    from labkit.fabric import set_link_rates

    dist.barrier()
    if dist.get_rank() == 0:
        set_link_rates(fab.links, gbit * GBIT)
    dist.barrier()


def _link_deltas(fab: Any, fn) -> dict[str, Any]:
    """Every link's counters across ``fn()`` on all ranks, fenced by barriers; every rank gets them."""
    import torch.distributed as dist

    from labkit.fabric import delta

    dist.barrier()
    before = fab.link_bytes() if dist.get_rank() == 0 else None
    dist.barrier()
    fn()
    dist.barrier()
    shared = [delta(before, fab.link_bytes()) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def _per_message_byte(fab: Any, message_elems: int, dtype: Any) -> dict[str, float]:
    """Bytes this rank's link carried up per message byte, for one call of each collective of :data:`RING_OPS`."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    full = torch.ones(message_elems * world, dtype=dtype)
    shard = torch.ones(message_elems, dtype=dtype)
    # torch 2.13 renamed the *_tensor forms; older torch has only those.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    calls = {"all_reduce": lambda: dist.all_reduce(full), "all_gather": lambda: all_gather(full, shard),
             "reduce_scatter": lambda: reduce_scatter(shard, full)}
    link = f"node{dist.get_rank()}"
    return {op: _link_deltas(fab, call)[link].tx_payload_bytes / (full.numel() * full.element_size())
            for op, call in calls.items()}


def measure_on_links(fab: Any, stages: Sequence[int], engines: Sequence[Any], batches: Sequence[Any],
                     step, size: TrafficSize) -> list[StageTraffic]:
    """Rank function part: one counted step per engine, then timed steps on the slow link.

    ``step(engine, batch)`` runs one training step and returns its ms. Engines take
    turns step by step, so load from elsewhere hits every stage alike; each stage's
    fastest step on its slowest rank is kept. The same engines' steps on the fast
    link are the probe's own timings.
    """
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    link = f"node{rank}"
    per_message_byte = _per_message_byte(fab, 2**20, next(engines[0].module.parameters()).dtype)
    counted = [_link_deltas(fab, lambda e=e, b=b: step(e, b))[link] for e, b in zip(engines, batches)]
    _set_rate(fab, size.slow_gbit)
    best = [float("inf")] * len(engines)
    for _ in range(size.timed_steps):
        for i, (engine, batch) in enumerate(zip(engines, batches)):
            dist.barrier()
            best[i] = min(best[i], step(engine, batch))
    _set_rate(fab, FAST_GBIT)
    slowest = torch.tensor(best, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return [StageTraffic(stage=s, sent_bytes=c.tx_payload_bytes, wire_bytes=c.tx_wire_bytes,
                         slow_step_ms=slowest[i].item(), sent_per_message_byte=per_message_byte)
            for i, (s, c) in enumerate(zip(stages, counted))]
