"""Counting collectives, a ring cost model, and an explicit slow-link emulation.

Data parallelism pays for every optimizer step with collectives whose cost is set
by bytes and links, not by FLOPs. This module gives the three tools Lab 5 (and
Labs 6 and 8) need to reason about that cost:

* a pure **alpha-beta model of the ring algorithms** (``ring_bytes_per_rank``,
  ``collective_time_s``): an all-reduce of M bytes over N ranks sends
  2(N-1)/N * M bytes from every rank, an all-gather or reduce-scatter (N-1)/N * M;
  each of the ring's steps also pays the link latency once;
* a **counter** (:class:`CommCounter`) that sees the collectives a rank really
  issues and adds up calls and bytes per operation;
* a **link emulation**: with ``link=`` set, the counter sleeps after each real
  collective for the time the model gives for that many bytes on that link, so
  two processes on one box behave like two nodes on a slow network. It is an
  emulation, named as such, and it is off (``link=None``) on real hardware, where
  the real network is measured instead.

How each code path is counted:

* Python callers (your loops, DeepSpeed's ``deepspeed.comm``, tensor-parallel
  layers) call ``torch.distributed.all_reduce`` & co. through the module
  attribute at call time. While a counter is active those attributes (in
  ``torch.distributed`` and ``torch.distributed.distributed_c10d``) are replaced
  by counting wrappers. Code that bound a function earlier
  (``from torch.distributed import all_reduce``) is not seen.
* DDP's reducer all-reduces gradient buckets from C++, never through those
  attributes. :func:`register_counting_hook` installs a DDP communication hook
  (``register_comm_hook``) that performs the same averaging all-reduce and counts
  each bucket on the given counter (and emulates the link there).

Message sizes follow nccl-tests: the all-reduce input, the all-gather *output*,
the reduce-scatter *input*, the all-to-all input, the broadcast tensor. Timing
them on real ranks is :mod:`labkit.collective_bench`.
"""

from __future__ import annotations

import inspect
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist



@dataclass(frozen=True)
class Link:
    """A network link for the alpha-beta model: latency per message step, bandwidth."""

    name: str
    bandwidth_gbps: float
    latency_us: float

    def __post_init__(self) -> None:
        if not self.bandwidth_gbps > 0:
            raise ValueError(f"bandwidth_gbps must be > 0, got {self.bandwidth_gbps}")
        if not self.latency_us >= 0:
            raise ValueError(f"latency_us must be >= 0, got {self.latency_us}")

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9 / 8


LINKS: dict[str, Link] = {
    link.name: link
    for link in (
        Link("1 Gbps", bandwidth_gbps=1.0, latency_us=50.0),
        Link("4 Gbps Ethernet", bandwidth_gbps=4.0, latency_us=30.0),
        Link("100 Gbps", bandwidth_gbps=100.0, latency_us=5.0),
        Link("NVLink-class", bandwidth_gbps=2400.0, latency_us=2.0),
    )
}

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


def check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")


def _check_sizes(message_bytes: int, world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if message_bytes < 0:
        raise ValueError(f"message_bytes must be >= 0, got {message_bytes}")


def ring_steps(op: str, world_size: int) -> int:
    """Message steps of the ring algorithm; each pays the link latency once."""
    check_op(op)
    _check_sizes(0, world_size)
    if op == "all_reduce":
        return 2 * (world_size - 1)
    return world_size - 1


def ring_bytes_per_rank(op: str, message_bytes: int, world_size: int) -> int:
    """Bytes each rank sends under the ring algorithm for a ``message_bytes`` tensor.

    All-reduce is a reduce-scatter followed by an all-gather, hence twice (N-1)/N.
    Broadcast is a pipelined chain whose busiest rank forwards the whole message.
    Rounded up to whole bytes (exact whenever N divides the message, as it does
    for fp32 tensors on 2 or 4 ranks).
    """
    check_op(op)
    _check_sizes(message_bytes, world_size)
    n = world_size
    if n == 1:
        return 0
    if op == "all_reduce":
        return -(-2 * (n - 1) * message_bytes // n)
    if op == "broadcast":
        return message_bytes
    return -(-(n - 1) * message_bytes // n)


def bus_bandwidth_factor(op: str, world_size: int) -> float:
    """nccl-tests' busbw / algbw: how much of the message each rank's link carries."""
    check_op(op)
    _check_sizes(0, world_size)
    n = world_size
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op == "broadcast":
        return 1.0
    return (n - 1) / n


def collective_time_s(op: str, message_bytes: int, world_size: int, link: Link) -> float:
    """Alpha-beta time of one ring collective: steps x latency + bytes per rank / bandwidth."""
    steps = ring_steps(op, world_size)
    sent = ring_bytes_per_rank(op, message_bytes, world_size)
    return steps * link.latency_us * 1e-6 + sent / link.bytes_per_s


@dataclass
class OpCount:
    calls: int = 0
    message_bytes: int = 0
    ring_bytes: int = 0


@dataclass(frozen=True)
class CallRecord:
    op: str
    message_bytes: int
    world_size: int
    ring_bytes: int
    emulated_s: float


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _group_size(group: Any) -> int:
    return dist.get_world_size(group) if group is not None else dist.get_world_size()


def _message_bytes_all_reduce(a: dict) -> int:
    return _tensor_bytes(a["tensor"])


def _message_bytes_all_gather_into_tensor(a: dict) -> int:
    return _tensor_bytes(a["output_tensor"])


def _message_bytes_all_gather(a: dict) -> int:
    return sum(_tensor_bytes(t) for t in a["tensor_list"])


def _message_bytes_reduce_scatter_tensor(a: dict) -> int:
    return _tensor_bytes(a["input"])


def _message_bytes_reduce_scatter(a: dict) -> int:
    return sum(_tensor_bytes(t) for t in a["input_list"])


def _message_bytes_all_to_all_single(a: dict) -> int:
    return _tensor_bytes(a["input"])


def _message_bytes_broadcast(a: dict) -> int:
    return _tensor_bytes(a["tensor"])


WRAPPED: dict[str, tuple[str, Callable[[dict], int]]] = {
    "all_reduce": ("all_reduce", _message_bytes_all_reduce),
    "all_gather_into_tensor": ("all_gather", _message_bytes_all_gather_into_tensor),
    "all_gather": ("all_gather", _message_bytes_all_gather),
    "reduce_scatter_tensor": ("reduce_scatter", _message_bytes_reduce_scatter_tensor),
    "reduce_scatter": ("reduce_scatter", _message_bytes_reduce_scatter),
    "all_to_all_single": ("all_to_all", _message_bytes_all_to_all_single),
    "broadcast": ("broadcast", _message_bytes_broadcast),
}
"""torch.distributed function -> (op it counts as, how to read its message size)."""

_NAMESPACES = (dist, dist.distributed_c10d)
_inside = threading.local()


class _EmulatedWork:
    """An async collective's handle that adds the emulated link time on completion."""

    def __init__(self, work: Any, sleep: Callable[[], None]):
        self._work = work
        self._sleep = sleep
        self._slept = False
        self._lock = threading.Lock()

    def _sleep_once(self) -> None:
        with self._lock:
            if not self._slept:
                self._slept = True
                self._sleep()

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        result = self._work.wait(*args, **kwargs)
        self._sleep_once()
        return result

    def get_future(self) -> torch.futures.Future:
        def after(fut: torch.futures.Future) -> Any:
            self._sleep_once()
            return fut.value()

        return self._work.get_future().then(after)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class CommCounter:
    """Count a rank's collectives (and optionally emulate a slow link) while active.

    ``with CommCounter(link=LINKS["4 Gbps Ethernet"]) as counter: train()`` then
    ``counter.counts["all_reduce"].ring_bytes``. ``group`` restricts counting to
    collectives on that process group (``None``: every group). ``emulated_s`` is
    the total time slept by the emulation; ``real_s`` the time spent inside the
    real (synchronous) collectives, reported separately.
    """

    def __init__(self, link: Link | None = None, group: Any = None):
        if link is not None and not isinstance(link, Link):
            raise ValueError(f"link must be a Link or None, got {link!r}")
        self.link = link
        self.group = group
        self.counts: dict[str, OpCount] = {op: OpCount() for op in OPS}
        self.records: list[CallRecord] = []
        self.emulated_s = 0.0
        self.real_s = 0.0
        self._saved: list[tuple[Any, str, Any]] = []
        self._lock = threading.Lock()

    def __enter__(self) -> "CommCounter":
        if not dist.is_initialized():
            raise RuntimeError("CommCounter needs an initialised process group (use labkit.launcher.launch)")
        for namespace in _NAMESPACES:
            for name in WRAPPED:
                original = getattr(namespace, name)
                self._saved.append((namespace, name, original))
                setattr(namespace, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc: object) -> None:
        for namespace, name, original in reversed(self._saved):
            setattr(namespace, name, original)
        self._saved.clear()

    def reset(self) -> None:
        """Zero the counts (e.g. after warm-up steps) without leaving the context."""
        with self._lock:
            self.counts = {op: OpCount() for op in OPS}
            self.records = []
            self.emulated_s = 0.0
            self.real_s = 0.0

    def counts_group(self, group: Any) -> bool:
        return self.group is None or group is self.group or (group is None and self.group is dist.group.WORLD)

    def record(self, op: str, message_bytes: int, world_size: int) -> float:
        """Count one collective; returns the emulated seconds to sleep for it (0 without a link)."""
        sent = ring_bytes_per_rank(op, message_bytes, world_size)
        emulated = collective_time_s(op, message_bytes, world_size, self.link) if self.link else 0.0
        with self._lock:
            count = self.counts[op]
            count.calls += 1
            count.message_bytes += message_bytes
            count.ring_bytes += sent
            self.emulated_s += emulated
            self.records.append(CallRecord(op, message_bytes, world_size, sent, emulated))
        return emulated

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        op, read_bytes = WRAPPED[name]
        signature = inspect.signature(original)

        def counted(*args: Any, **kwargs: Any) -> Any:
            if getattr(_inside, "depth", 0):
                return original(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            arguments = bound.arguments
            group = arguments.get("group")
            if not self.counts_group(group):
                return original(*args, **kwargs)
            emulated = self.record(op, read_bytes(arguments), _group_size(group))
            _inside.depth = 1
            try:
                start = time.perf_counter()
                work = original(*args, **kwargs)
                if not arguments.get("async_op"):
                    self.real_s += time.perf_counter() - start
            finally:
                _inside.depth = 0
            if emulated <= 0:
                return work
            if arguments.get("async_op") and work is not None:
                return _EmulatedWork(work, lambda: time.sleep(emulated))
            time.sleep(emulated)
            return work

        counted._labkit_original = original  # type: ignore[attr-defined]
        counted.__name__ = name
        return counted

    def as_dict(self) -> dict[str, Any]:
        """Picklable summary (what rank functions return)."""
        return {
            "counts": {op: asdict(c) for op, c in self.counts.items()},
            "emulated_s": self.emulated_s,
            "real_s": self.real_s,
            "link": self.link.name if self.link else None,
        }


def register_counting_hook(ddp_model: Any, counter: CommCounter) -> None:
    """Make DDP's gradient all-reduce visible to ``counter`` (and to its link emulation).

    DDP's reducer issues bucket all-reduces from C++, so wrapping Python functions
    cannot see them. This hook does what DDP's default does (average the bucket
    with one all-reduce), counts the bucket on ``counter`` and, with a link set,
    delays the bucket's completion by the emulated transfer time, so the emulated
    link overlaps backward compute just as a real network would.
    """
    all_reduce = dist.distributed_c10d.all_reduce
    while hasattr(all_reduce, "_labkit_original"):
        all_reduce = all_reduce._labkit_original

    def hook(state, bucket):  # DDP checks these annotations, so none (they would be strings here)
        group = state if state is not None else dist.group.WORLD
        world_size = dist.get_world_size(group)
        tensor = bucket.buffer()
        emulated = counter.record("all_reduce", _tensor_bytes(tensor), world_size)
        tensor.div_(world_size)
        fut = all_reduce(tensor, group=group, async_op=True).get_future()

        def done(fut: torch.futures.Future) -> torch.Tensor:
            if emulated > 0:
                time.sleep(emulated)
            return fut.value()[0]

        return fut.then(done)

    ddp_model.register_comm_hook(None, hook)


def counting_wrappers_removed() -> bool:
    """True once no counter's wrapper is left on ``torch.distributed``: a counter must undo itself on exit."""
    return all(not hasattr(getattr(ns, name), "_labkit_original") for ns in _NAMESPACES for name in WRAPPED)


__all__ = [
    "Link",
    "LINKS",
    "OPS",
    "OpCount",
    "CallRecord",
    "CommCounter",
    "check_op",
    "counting_wrappers_removed",
    "ring_steps",
    "ring_bytes_per_rank",
    "bus_bandwidth_factor",
    "collective_time_s",
    "register_counting_hook",
]
