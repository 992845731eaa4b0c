"""Split each training step of a torch.profiler trace into what the step waited on.

The categories are the course's bottlenecks, each treated by one lab: ``data``
(Lab 1: the training thread waiting in a DataLoader's ``__next__``),
``host_to_device`` (Lab 3: copies onto the accelerator), ``compute`` (Labs 3-4),
``communication`` (Labs 5-6: collectives the step waited for, i.e. not hidden
behind compute), ``checkpoint`` (Lab 7: saves on the training thread) and
``other`` (Python and framework time between ops).

Each instant of a step is counted once, in that order of precedence, as
TensorBoard's profiler plugin did (kernel > memcpy > communication > DataLoader >
CPU op > other): an op inside a DataLoader's ``__next__`` is data, a tensor copy
inside a checkpoint save is checkpoint, and a collective running while the
training thread computes is hidden, so only its exposed part counts. Steps are
the ``ProfilerStep#N`` spans that ``labkit.diagnose`` opens at each optimizer
step.

Only the trace's names are read, so the rules are listed here, in one place:
on the CPU a collective is a ``gloo:*`` span on gloo's worker thread (it starts
when the work runs and includes waiting for the slowest peer), and the training
thread's ``c10d::*`` ops are its calls into the process group, and a step that an
accelerator process computes is the span :data:`ACCELERATOR_SPAN`; on a GPU compute is
the kernels, a collective is an NCCL kernel, and a copy is a ``Memcpy HtoD``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

CATEGORIES = ("data", "host_to_device", "compute", "communication", "checkpoint", "other")
CHECKPOINT_SPAN = "labkit.diagnose: checkpoint"
"""The name ``labkit.diagnose`` gives the spans it wraps around ``torch.save`` and DCP saves."""
ACCELERATOR_SPAN = "labkit: accelerator step"
"""The span around a step that an accelerator outside this thread computes (Lab 1's on a CPU-only machine:
:class:`labkit.accelerator.CoreAccelerator`'s process, or the sleeping stand-in on one core): the training
thread waits in it as a GPU's host waits for its kernels, so on the CPU it counts as compute. The ops
that process runs are not in this trace, so none of that time is split by the roofline."""

Interval = tuple[float, float]

_DATA = re.compile(r"^enumerate\(DataLoader\)#.*__next__")
_COLLECTIVE = re.compile(r"^(gloo|nccl):|^ncclDevKernel|^ncclKernel", re.IGNORECASE)
_PROCESS_GROUP_CALL = re.compile(r"^c10d::|^record_param_comms$")
_HOST_TO_DEVICE = re.compile(r"Memcpy HtoD|memcpy.*HtoD", re.IGNORECASE)
_STEP = re.compile(r"^ProfilerStep#(\d+)$")


@dataclass(frozen=True)
class StepShares:
    """One step of one rank: its length and the fraction of it each category took (they sum to 1)."""
    step: int
    step_ms: float
    shares: dict[str, float]
    memory_bound_ms: float = 0.0
    """Compute time in ops whose arithmetic intensity sits below the machine's ridge (see :func:`memory_bound`);
    NaN on a GPU trace, whose kernels carry no FLOP counts."""


@dataclass(frozen=True)
class RankBreakdown:
    rank: int
    steps: list[StepShares] = field(default_factory=list)

    @property
    def step_ms(self) -> float:
        return sum(s.step_ms for s in self.steps) / len(self.steps)

    def shares(self) -> dict[str, float]:
        """Time-weighted over the steps: the share of all profiled time, not a mean of ratios."""
        total = sum(s.step_ms for s in self.steps)
        return {c: sum(s.shares[c] * s.step_ms for s in self.steps) / total for c in CATEGORIES}

    @property
    def memory_bound_share_of_compute(self) -> float | None:
        if any(math.isnan(s.memory_bound_ms) for s in self.steps):
            return None
        compute = sum(s.shares["compute"] * s.step_ms for s in self.steps)
        return sum(s.memory_bound_ms for s in self.steps) / compute if compute > 0 else 0.0


def union(intervals: list[Interval]) -> list[Interval]:
    """Sorted, non-overlapping intervals covering the same instants."""
    merged: list[list[float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def subtract(these: list[Interval], minus: list[Interval]) -> list[Interval]:
    """The instants of ``these`` not in ``minus`` (both unions)."""
    out: list[Interval] = []
    j = 0
    for start, end in these:
        while j < len(minus) and minus[j][1] <= start:
            j += 1
        k, cursor = j, start
        while k < len(minus) and minus[k][0] < end:
            if minus[k][0] > cursor:
                out.append((cursor, minus[k][0]))
            cursor = max(cursor, minus[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def clip(intervals: list[Interval], window: Interval) -> list[Interval]:
    return [(max(a, window[0]), min(b, window[1])) for a, b in intervals if b > window[0] and a < window[1]]


def length(intervals: list[Interval]) -> float:
    return sum(b - a for a, b in intervals)


def _spans(events: list[dict]) -> list[Interval]:
    return union([(e["ts"], e["ts"] + e["dur"]) for e in events])


def training_thread(events: list[dict]) -> object:
    """The thread whose ``ProfilerStep#N`` spans mark the steps."""
    tids = {e["tid"] for e in events if _STEP.match(e["name"])}
    if len(tids) != 1:
        raise ValueError(f"expected the ProfilerStep spans on one thread, found them on {len(tids)}; "
                         "was the trace recorded by labkit.diagnose?")
    return tids.pop()


def attribute_rank(trace: dict, rank: int, *, ridge_flop_per_byte: float = math.inf) -> RankBreakdown:
    """Each profiled step of one rank's Chrome trace (``torch.profiler`` export), split into :data:`CATEGORIES`.

    Where the trace has GPU kernels, the device's time comes first (kernels >
    copies > NCCL kernels > the host waiting for data or a save), as in
    TensorBoard's plugin: a DataLoader wait while kernels still run is hidden. On
    the CPU the training thread does everything in turn, so an op inside a
    DataLoader's ``__next__`` or a save is data or checkpoint, not compute, and
    gloo's worker thread is exposed only where the training thread is not
    computing.
    """
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    main = training_thread(events)
    on_main = [e for e in events if e["tid"] == main]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    data = _spans([e for e in on_main if _DATA.match(e["name"])])
    checkpoint = _spans([e for e in on_main if e["name"].startswith(CHECKPOINT_SPAN)])
    if gpu:
        compute_events = [e for e in gpu if e.get("cat") == "kernel" and not _COLLECTIVE.match(e["name"])]
        compute = _spans(compute_events)
        collectives = _spans([e for e in gpu if e.get("cat") == "kernel" and _COLLECTIVE.match(e["name"])])
        order = ("compute", "host_to_device", "communication", "data", "checkpoint")
    else:
        pg_calls = _spans([e for e in on_main if e.get("cat") == "cpu_op" and _PROCESS_GROUP_CALL.match(e["name"])])
        compute_events = [e for e in on_main if e.get("cat") == "cpu_op" and not _PROCESS_GROUP_CALL.match(e["name"])]
        accelerator = _spans([e for e in on_main if e["name"] == ACCELERATOR_SPAN])
        compute = union(subtract(_spans(compute_events), pg_calls) + accelerator)
        collectives = union(_spans([e for e in events if _COLLECTIVE.match(e["name"])]) + pg_calls)
        order = ("data", "checkpoint", "host_to_device", "compute", "communication")
    spans = {"data": data, "checkpoint": checkpoint, "compute": compute, "communication": collectives,
             "host_to_device": _spans([e for e in gpu if _HOST_TO_DEVICE.search(e["name"])])}
    # A wrapper op (aten::linear) counts no FLOPs itself; the matmul inside it does, so its time is taken out.
    arithmetic = _spans([e for e in compute_events if e.get("args", {}).get("flops")
                         and not memory_bound(e, ridge_flop_per_byte)])
    bound_spans = subtract(_spans([e for e in compute_events if memory_bound(e, ridge_flop_per_byte)]), arithmetic)
    if gpu:  # kernels carry no FLOPs or shapes in the trace: not split until mapped to their ops
        bound_spans = None
    steps = [_split(e, order, spans, bound_spans)
             for e in sorted((e for e in on_main if _STEP.match(e["name"])), key=lambda e: e["ts"])]
    if not steps:
        raise ValueError("the trace holds no ProfilerStep spans: no optimizer step ran while it was recorded")
    return RankBreakdown(rank, steps)


def _split(step: dict, order: tuple[str, ...], spans: dict[str, list[Interval]],
           bound_spans: list[Interval] | None) -> StepShares:
    """One step's instants, each given to the first category in ``order`` that covers it."""
    window = (step["ts"], step["ts"] + step["dur"])
    claimed: list[Interval] = []
    took: dict[str, float] = {}
    compute_instants: list[Interval] = []
    for name in order:
        mine = subtract(clip(spans[name], window), claimed)
        took[name] = length(mine)
        if name == "compute":
            compute_instants = mine
        claimed = union(claimed + mine)
    total = window[1] - window[0]
    took["other"] = total - length(claimed)
    bound = math.nan if bound_spans is None else length(clip_to(bound_spans, compute_instants))
    return StepShares(int(_STEP.match(step["name"]).group(1)), total / 1e3,
                      {c: took[c] / total for c in CATEGORIES}, bound / 1e3)


def clip_to(these: list[Interval], within: list[Interval]) -> list[Interval]:
    """The instants of ``these`` that also lie in ``within`` (both unions)."""
    return subtract(these, subtract(union(these), within))


def memory_bound(event: dict, ridge_flop_per_byte: float) -> bool:
    """Whether an op moved more bytes than its FLOPs keep busy, by Lab 3's roofline.

    The profiler counts FLOPs only for matmuls and convolutions (``with_flops``);
    every other op (elementwise, reductions, copies, normalisation) does about one
    FLOP per element or less, far under any machine's ridge, so it is memory-bound.
    A counted op's bytes are its inputs' and output's sizes from ``record_shapes``.
    """
    args = event.get("args", {})
    flops = args.get("flops")
    if not flops:
        return _is_leaf_math(event["name"])
    moved = _bytes_of(args)
    return moved > 0 and flops / moved < ridge_flop_per_byte


def _is_leaf_math(name: str) -> bool:
    return name.startswith("aten::") and name not in ("aten::empty", "aten::empty_strided", "aten::view",
                                                      "aten::as_strided", "aten::t", "aten::transpose",
                                                      "aten::expand", "aten::detach", "aten::resolve_conj")


_DTYPE_BYTES = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4,
                "signed char": 1, "unsigned char": 1, "bool": 1}


def _bytes_of(args: dict) -> float:
    dims, types = args.get("Input Dims", []), args.get("Input type", [])
    total = 0.0
    for shape, dtype in zip(dims, types):
        if isinstance(shape, list) and shape and all(isinstance(d, int) for d in shape):
            total += math.prod(shape) * _DTYPE_BYTES.get(dtype, 4)
    return total
