"""ZeRO-3 and ZeRO++ training steps on real ranks, measured under an emulated slow link.

Each rank keeps only its fp32 master shard of a small MLP (ZeRO-3). A step
all-gathers the weights for the forward pass, frees them (their storage is
really released, as ZeRO-3 and FSDP do), all-gathers them again for the
backward pass, then reduce-scatters the gradients so each rank updates its own
shard. ``Variant`` switches on ZeRO++'s qwZ, hpZ and qgZ one by one or together
(``labkit.quantcomm`` holds the collectives). The ranks are mapped onto nodes
(``NodeLayout``, e.g. 2 nodes x 2 ranks) and the link emulation slows only the
collectives whose group crosses nodes; intra-node traffic runs at loopback speed.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit.collectives import LINKS, CommCounter, Link
from labkit.devices import synchronize
from labkit.launcher import rank_info
from labkit.quantcomm import (
    NodeLayout,
    StepCommBytes,
    all_gather_plain,
    all_gather_quantized,
    check_bits,
    check_block_size,
    error_bound_per_element,
    node_groups,
    reduce_scatter_plain,
    reduce_scatter_quantized,
    zero_step_comm_bytes,
)

SIZES = {
    "ci": {
        "dims": (512, 1024, 1024, 512),
        "batch": 4,
        "timed_steps": 3,
        "train_steps": 20,
        "bandwidths_gbps": (0.5, 1.0, 4.0, 100.0),
        "comm_dtype": "float32",
    },
    "gpu": {
        "dims": (512, 1024, 1024, 512),
        "batch": 4,
        "timed_steps": 5,
        "train_steps": 60,
        "bandwidths_gbps": (0.5, 1.0, 4.0, 16.0, 100.0),
        "comm_dtype": "float32",
    },
    "multi-gpu": {
        "dims": (1024, 2048, 2048, 1024),
        "batch": 8,
        "timed_steps": 10,
        "train_steps": 100,
        "bandwidths_gbps": (0.5, 1.0, 4.0, 16.0, 100.0, 400.0),
        "comm_dtype": "float32",
    },
}


@dataclass(frozen=True)
class Variant:
    """Which ZeRO++ options are on; all off is plain ZeRO-3."""

    name: str
    qwz: bool = False
    hpz: bool = False
    qgz: bool = False


VARIANTS = (
    Variant("ZeRO-3"),
    Variant("qwZ", qwz=True),
    Variant("hpZ", hpz=True),
    Variant("qgZ", qgz=True),
    Variant("ZeRO++", qwz=True, hpz=True, qgz=True),
)
BF16_BASELINE = Variant("ZeRO-3 bf16")
"""ZeRO-3 communicating in 16 bits, the paper's baseline, beside the fp32 one we train with."""


def link_for(bandwidth_gbps: float) -> Link:
    """A named link from Lab 5's table when one matches, else one with its latency."""
    for link in LINKS.values():
        if math.isclose(link.bandwidth_gbps, bandwidth_gbps):
            return link
    return Link(f"{bandwidth_gbps:g} Gbps", bandwidth_gbps=bandwidth_gbps, latency_us=10.0)


class NodeAwareCounter(CommCounter):
    """Lab 5's counter, split by where a collective's group lives: across nodes or inside one.

    Cross-node collectives land in ``counts`` and pay the emulated ``link``;
    collectives whose group stays inside one node land in ``intra.counts`` and
    run at loopback speed (intra-node links are fast). ``CommCounter(group=...)``
    matches one group object; ZeRO++ needs the split by node, so this subclass
    classifies each call's group with the ``NodeLayout``.
    """

    def __init__(self, layout: NodeLayout, link: Link | None = None):
        super().__init__(link=link)
        self.layout = layout
        self.intra = CommCounter()
        self._crossing = True

    def counts_group(self, group: Any) -> bool:
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        self._crossing = self.layout.spans_nodes(list(ranks))
        return True

    def record(self, op: str, message_bytes: int, world_size: int) -> float:
        if self._crossing:
            return super().record(op, message_bytes, world_size)
        self.intra.record(op, message_bytes, world_size)
        return 0.0

    def cross_node_bytes(self) -> int:
        return sum(count.ring_bytes for count in self.counts.values())

    def intra_node_bytes(self) -> int:
        return sum(count.ring_bytes for count in self.intra.counts.values())


def flat_numel(dims: tuple[int, ...]) -> int:
    return sum(fan_in * fan_out + fan_out for fan_in, fan_out in zip(dims[:-1], dims[1:]))


def padded_params(dims: tuple[int, ...], *, world_size: int, block_size: int) -> int:
    """Parameter count padded so every shard and every qgZ chunk holds whole blocks and bytes."""
    unit = world_size * math.lcm(block_size, 4)
    return -(-flat_numel(dims) // unit) * unit


def layer_views(flat: torch.Tensor, dims: tuple[int, ...]) -> list[torch.Tensor]:
    """Weight and bias views into one flat vector (the gathered ZeRO-3 buffer), in layer order."""
    views, offset = [], 0
    for fan_in, fan_out in zip(dims[:-1], dims[1:]):
        views.append(flat[offset : offset + fan_in * fan_out].view(fan_out, fan_in))
        offset += fan_in * fan_out
        views.append(flat[offset : offset + fan_out])
        offset += fan_out
    return views


def mlp(params: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """A ReLU MLP over ``layer_views``' weights and biases."""
    layers = len(params) // 2
    for i in range(layers):
        x = F.linear(x, params[2 * i], params[2 * i + 1])
        if i < layers - 1:
            x = torch.relu(x)
    return x


def init_flat(dims: tuple[int, ...], numel: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    flat = torch.zeros(numel)
    offset = 0
    for fan_in, fan_out in zip(dims[:-1], dims[1:]):
        flat[offset : offset + fan_in * fan_out] = torch.randn(fan_in * fan_out, generator=gen) / math.sqrt(fan_in)
        offset += fan_in * fan_out + fan_out
    return flat


def batch(dims: tuple[int, ...], teacher: torch.Tensor, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and a fixed teacher network's outputs: a task with a known, reachable loss."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(size, dims[0], generator=gen).to(teacher.device)
    with torch.no_grad():
        return x, mlp(layer_views(teacher, dims), x)


class ZeroRank:
    """One rank of a ZeRO-3 (or ZeRO++) data-parallel job: fp32 master shard plus Adam state."""

    def __init__(
        self,
        variant: Variant,
        dims: tuple[int, ...],
        layout: NodeLayout,
        node_group: Any,
        *,
        weight_bits: int = 8,
        grad_bits: int = 4,
        block_size: int = 256,
        comm_dtype: torch.dtype = torch.float32,
        lr: float = 1e-3,
        seed: int = 0,
    ):
        self.variant, self.dims, self.layout, self.node_group = variant, dims, layout, node_group
        self.comm_dtype = comm_dtype
        self.device = torch.device(rank_info().device)
        self.weight_bits, self.grad_bits, self.block_size = weight_bits, grad_bits, block_size
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.numel = padded_params(dims, world_size=self.world, block_size=block_size)
        shard_numel = self.numel // self.world
        full = init_flat(dims, self.numel, seed)
        self.shard = torch.nn.Parameter(full[self.rank * shard_numel : (self.rank + 1) * shard_numel].to(self.device))
        self.optimizer = torch.optim.Adam([self.shard], lr=lr)
        self.secondary: torch.Tensor | None = None

    def gather_weights(self, phase: str) -> torch.Tensor:
        """The full fp32 weights; where they come from depends on the variant and the phase."""
        if phase == "backward" and self.variant.hpz:
            return all_gather_plain(self.secondary, group=self.node_group, comm_dtype=self.comm_dtype)
        if self.variant.qwz:
            full = all_gather_quantized(self.shard, bits=self.weight_bits, block_size=self.block_size)
            if self.variant.hpz and self.comm_dtype != torch.float32:
                # the secondary copy must hold exactly the weights the forward pass used
                return full.to(self.comm_dtype).float()
            return full
        return all_gather_plain(self.shard, comm_dtype=self.comm_dtype)

    def keep_secondary(self, full: torch.Tensor) -> None:
        """hpZ: keep this rank's slice of the node-level partition of the gathered weights."""
        per_rank = self.numel // self.layout.ranks_per_node
        local = self.rank % self.layout.ranks_per_node
        self.secondary = full[local * per_rank : (local + 1) * per_rank].to(self.comm_dtype, copy=True)

    def reduce_gradients(self, grad: torch.Tensor) -> torch.Tensor:
        if self.variant.qgz:
            summed = reduce_scatter_quantized(grad, bits=self.grad_bits, block_size=self.block_size)
        else:
            summed = reduce_scatter_plain(grad, comm_dtype=self.comm_dtype)
        return summed / self.world

    def step(self, x: torch.Tensor, y: torch.Tensor, on_phase: Callable[[str], None] | None = None) -> float:
        """One optimizer step; ``on_phase(name)`` is called after each communication phase."""
        mark = on_phase or (lambda _: None)
        full = self.gather_weights("forward")
        mark("forward_allgather")
        params = [view.detach().requires_grad_(True) for view in layer_views(full, self.dims)]
        loss = F.mse_loss(mlp(params, x), y)
        if self.variant.hpz:
            self.keep_secondary(full)
        storage_bytes = full.untyped_storage().nbytes()
        full.untyped_storage().resize_(0)
        regathered = self.gather_weights("backward")
        full.untyped_storage().resize_(storage_bytes)
        full.data.copy_(regathered)  # .data: autograd must not see the refill as a modification
        mark("backward_allgather")
        grads = torch.autograd.grad(loss, params)
        padding = torch.zeros(self.numel - flat_numel(self.dims), device=self.device)
        grad_shard = self.reduce_gradients(torch.cat([g.reshape(-1) for g in grads] + [padding]))
        mark("grad_reduce_scatter")
        full.untyped_storage().resize_(0)
        self.shard.grad = grad_shard
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


def _device() -> torch.device:
    return torch.device(rank_info().device)


def _mean_over_ranks(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=_device())
    dist.all_reduce(tensor)
    return tensor.item() / dist.get_world_size()


def _max_over_ranks(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def measure_bytes(job: ZeroRank, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """Cross-node and intra-node bytes of one step, per phase, from the counters."""
    phases: dict[str, int] = {}
    with NodeAwareCounter(job.layout) as counter:
        seen = [0]

        def on_phase(name: str) -> None:
            phases[name] = counter.cross_node_bytes() - seen[0]
            seen[0] = counter.cross_node_bytes()

        job.step(x, y, on_phase)
    return {"cross_node_phases": phases, "cross_node_bytes": counter.cross_node_bytes(),
            "intra_node_bytes": counter.intra_node_bytes(),
            "cross_node_calls": sum(c.calls for c in counter.counts.values())}


def time_variants(
    jobs: dict[str, ZeroRank], x: torch.Tensor, y: torch.Tensor, link: Link | None, steps: int
) -> dict[str, dict[str, float]]:
    """Median ms per step of each variant (slowest rank each step), cross-node link emulated or not.

    Variants take turns step by step, so a change in background load hits all of
    them alike instead of whichever happened to run at that moment. ``cpu_ms`` is
    the busiest rank's CPU time per step (compute, quantization, gloo's copies):
    the part the emulated link does not add.
    """
    names = list(jobs)
    step_s = torch.zeros(len(names), steps, dtype=torch.float64)
    cpu_s = torch.zeros(len(names), dtype=torch.float64)
    emulated_s = [0.0] * len(names)
    for i in range(steps):
        for j, name in enumerate(names):
            job = jobs[name]
            synchronize(job.device)
            dist.barrier()
            with NodeAwareCounter(job.layout, link=link) as counter:
                cpu_start, start = time.process_time(), time.perf_counter()
                job.step(x, y)
                synchronize(job.device)
                step_s[j, i] = time.perf_counter() - start
                cpu_s[j] += time.process_time() - cpu_start
            emulated_s[j] += counter.emulated_s
    step_s, cpu_s = step_s.to(_device()), cpu_s.to(_device())
    dist.all_reduce(step_s, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu_s, op=dist.ReduceOp.MAX)
    return {
        name: {"step_ms": step_s[j].median().item() * 1e3, "cpu_ms": cpu_s[j].item() / steps * 1e3,
               "emulated_ms": emulated_s[j] / steps * 1e3}
        for j, name in enumerate(names)
    }


def gradient_error(job: ZeroRank, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """qgZ against the exact fp32 reduce-scatter of the same gradients, and its worst-case bound.

    Each rank's quantization moves an element by at most half its block's step,
    so the summed error is at most the sum of those half-steps over ranks.
    """
    full = all_gather_plain(job.shard, comm_dtype=torch.float32).requires_grad_(True)
    F.mse_loss(mlp(layer_views(full, job.dims), x), y).backward()
    grad = full.grad
    exact = reduce_scatter_plain(grad, comm_dtype=torch.float32)
    quantized = reduce_scatter_quantized(grad, bits=job.grad_bits, block_size=job.block_size)
    bound = reduce_scatter_plain(error_bound_per_element(grad, bits=job.grad_bits, block_size=job.block_size), comm_dtype=torch.float32)
    error = (quantized - exact).abs()
    tolerance = 1e-6 * exact.abs().max().item()
    return {
        "relative_error": error.norm().item() / exact.norm().item(),
        "relative_bound": bound.norm().item() / exact.norm().item(),
        "within_bound_everywhere": bool((error <= bound + tolerance).all().item()),
    }


def wire_bytes_vs_fp32(job: ZeroRank) -> dict[str, int]:
    """Counted bytes of quantized collectives against the same collectives in fp32."""
    out: dict[str, int] = {}
    grad = torch.randn(job.numel, generator=torch.Generator().manual_seed(job.rank)).to(job.device)
    runs = {
        "weights_fp32": lambda: all_gather_plain(job.shard, comm_dtype=torch.float32),
        "weights_int8": lambda: all_gather_quantized(job.shard, bits=8, block_size=job.block_size),
        "grads_fp32": lambda: reduce_scatter_plain(grad, comm_dtype=torch.float32),
        "grads_int4": lambda: reduce_scatter_quantized(grad, bits=4, block_size=job.block_size),
    }
    for name, run in runs.items():
        with CommCounter() as counter:
            run()
        out[name] = sum(c.ring_bytes for c in counter.counts.values())
    return out


def experiment_rank(
    dims: tuple[int, ...],
    ranks_per_node: int,
    batch_size: int,
    timed_steps: int,
    train_steps: int,
    bandwidths_gbps: tuple[float, ...],
    comm_dtype: str = "float32",
    weight_bits: int = 8,
    grad_bits: int = 4,
    block_size: int = 256,
    seed: int = 0,
) -> dict[str, Any]:
    """Rank function: bytes, emulated-link step times, gradient error, loss curves, hpZ memory."""
    dims = tuple(dims)
    layout = NodeLayout.for_world(dist.get_world_size(), ranks_per_node)
    node_group, _ = node_groups(layout)
    rank, device = dist.get_rank(), _device()
    teacher = init_flat(dims, flat_numel(dims), seed + 1000).to(device)
    x, y = batch(dims, teacher, batch_size, seed=10_000 + rank)
    options = dict(weight_bits=weight_bits, grad_bits=grad_bits, block_size=block_size,
                   comm_dtype=getattr(torch, comm_dtype), seed=seed)
    jobs = {v.name: ZeroRank(v, dims, layout, node_group, **options) for v in VARIANTS}
    if comm_dtype != "bfloat16":
        jobs[BF16_BASELINE.name] = ZeroRank(BF16_BASELINE, dims, layout, node_group,
                                            **{**options, "comm_dtype": torch.bfloat16})
    result: dict[str, Any] = {"rank": rank, "num_params": jobs["ZeRO-3"].numel, "layout": asdict(layout),
                              "comm_dtype": comm_dtype, "bandwidths_gbps": list(bandwidths_gbps),
                              "weight_bits": weight_bits, "grad_bits": grad_bits, "block_size": block_size,
                              "bytes": {}, "timing": {}, "loss": {}}
    for name, job in jobs.items():
        job.step(x, y)
        result["bytes"][name] = measure_bytes(job, x, y)
    for bandwidth in bandwidths_gbps:
        for name, timing in time_variants(jobs, x, y, link_for(bandwidth), timed_steps).items():
            result["timing"].setdefault(name, []).append(timing)
    result["grad_error"] = gradient_error(jobs["ZeRO-3"], x, y)
    result["wire_bytes"] = wire_bytes_vs_fp32(jobs["ZeRO-3"])
    hpz = jobs["hpZ"]
    result["hpz_secondary_bytes"] = hpz.secondary.numel() * hpz.secondary.element_size()
    result["primary_shard_bytes"] = hpz.shard.numel() * hpz.comm_dtype.itemsize
    for variant in (VARIANTS[0], VARIANTS[-1]):
        job = ZeroRank(variant, dims, layout, node_group, **options)
        losses = []
        for step in range(train_steps):
            xb, yb = batch(dims, teacher, batch_size, seed=step * 1000 + rank)
            losses.append(_mean_over_ranks(job.step(xb, yb)))
        result["loss"][variant.name] = losses
    return result


def traffic_calculator(
    params_billion: float,
    *,
    bandwidth_gbps: float,
    param_bytes: int = 2,
    qwz: bool = False,
    hpz: bool = False,
    qgz: bool = False,
) -> dict[str, float]:
    """What the widget shows: cross-node GB per step and the seconds the link needs for them.

    Paper accounting (no scales, no ring factor), so the numbers read as multiples of M.
    """
    if params_billion <= 0:
        raise ValueError(f"params_billion must be > 0, got {params_billion}")
    if bandwidth_gbps <= 0:
        raise ValueError(f"bandwidth_gbps must be > 0, got {bandwidth_gbps}")
    num_params = int(params_billion * 1e9)
    traffic = zero_step_comm_bytes(num_params, param_bytes=param_bytes, qwz=qwz, hpz=hpz, qgz=qgz)
    model = num_params * param_bytes
    return {
        "cross_node_gb": traffic.total / 1e9,
        "multiple_of_M": traffic.total / model,
        "link_s": traffic.total * 8 / (bandwidth_gbps * 1e9),
    }



def traffic_text(params_billion: float, bandwidth_gbps: float, qwz: bool, hpz: bool, qgz: bool) -> str:
    """The calculator's line: cross-node GB per step, as a multiple of M, and the link's seconds."""
    r = traffic_calculator(params_billion, bandwidth_gbps=bandwidth_gbps, qwz=qwz, hpz=hpz, qgz=qgz)
    return (f"{r['cross_node_gb']:.1f} GB cross-node per step ({r['multiple_of_M']:.2f}M), "
            f"{r['link_s']:.2f} s on the link")


def traffic_widget():
    """Controls over :func:`traffic_text` (see :mod:`labkit.widgets`)."""
    import ipywidgets as widgets

    from labkit.widgets import live

    controls = {
        "params_billion": widgets.FloatLogSlider(value=7, base=10, min=-1, max=2.5, description="params (B)"),
        "bandwidth_gbps": widgets.FloatLogSlider(value=100, base=10, min=0, max=3, description="link Gbit/s"),
        "qwz": widgets.Checkbox(value=False, description="qwZ"),
        "hpz": widgets.Checkbox(value=False, description="hpZ"),
        "qgz": widgets.Checkbox(value=False, description="qgZ"),
    }
    return live(traffic_text, controls, rows=[["params_billion", "bandwidth_gbps"], ["qwz", "hpz", "qgz"]])

COMM_DTYPES = ("float32", "bfloat16")


def model_bytes(variant: Variant, result: dict[str, Any]) -> StepCommBytes:
    """The volume model's cross-node bytes per rank for one variant of a finished run."""
    comm_dtype = "bfloat16" if variant == BF16_BASELINE else result["comm_dtype"]
    return zero_step_comm_bytes(
        result["num_params"],
        param_bytes=getattr(torch, comm_dtype).itemsize,
        qwz=variant.qwz,
        hpz=variant.hpz,
        qgz=variant.qgz,
        weight_bits=result["weight_bits"],
        grad_bits=result["grad_bits"],
        block_size=result["block_size"],
        world_size=result["layout"]["nodes"] * result["layout"]["ranks_per_node"],
    )


def bytes_vs_model(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Measured cross-node bytes per variant beside the model's, phase by phase."""
    rows = []
    for variant in (*VARIANTS, BF16_BASELINE):
        if variant.name not in result["bytes"]:
            continue
        measured = result["bytes"][variant.name]
        model = model_bytes(variant, result)
        rows.append({
            "variant": variant.name,
            "measured_bytes": measured["cross_node_bytes"],
            "model_bytes": model.total,
            "ratio": measured["cross_node_bytes"] / model.total,
            "phases_measured": measured["cross_node_phases"],
            "phases_model": {"forward_allgather": model.forward_allgather,
                             "backward_allgather": model.backward_allgather,
                             "grad_reduce_scatter": model.grad_reduce_scatter},
            "intra_node_bytes": measured["intra_node_bytes"],
        })
    return rows


def step_ms(result: dict[str, Any], variant: str) -> list[float]:
    """Median step time per emulated bandwidth, in ``result["bandwidths_gbps"]`` order."""
    return [t["step_ms"] for t in result["timing"][variant]]


def speedup(result: dict[str, Any], *, baseline: str = "ZeRO-3", variant: str = "ZeRO++") -> list[float]:
    """baseline step time / variant step time at each emulated bandwidth."""
    return [b / v for b, v in zip(step_ms(result, baseline), step_ms(result, variant))]


def check_config(world_size: int, ranks_per_node: int, weight_bits: int, grad_bits: int, block_size: int) -> NodeLayout:
    """Every bad input raises here, in the caller, before any rank starts."""
    check_bits(weight_bits)
    check_bits(grad_bits)
    check_block_size(block_size)
    layout = NodeLayout.for_world(world_size, ranks_per_node)
    if layout.nodes < 2:
        raise ValueError(f"need at least 2 nodes to have cross-node traffic, got world_size={world_size}, "
                         f"ranks_per_node={ranks_per_node}")
    return layout


def run_experiment(
    world_size: int = 4,
    ranks_per_node: int = 2,
    *,
    weight_bits: int = 8,
    grad_bits: int = 4,
    block_size: int = 256,
    timeout_s: float = 300.0,
    **overrides: Any,
) -> list[dict[str, Any]]:
    """Launch ``experiment_rank`` on ``world_size`` real ranks laid out as nodes of ``ranks_per_node``."""
    from labkit.launcher import launch
    from labkit.profiles import profile

    check_config(world_size, ranks_per_node, weight_bits, grad_bits, block_size)
    sizes = {**profile().pick(SIZES), **overrides}
    if sizes["comm_dtype"] not in COMM_DTYPES:
        raise ValueError(f"comm_dtype must be one of {COMM_DTYPES}, got {sizes['comm_dtype']!r}")
    if not all(b > 0 for b in sizes["bandwidths_gbps"]):
        raise ValueError(f"bandwidths_gbps must all be > 0, got {sizes['bandwidths_gbps']}")
    for key in ("timed_steps", "train_steps", "batch"):
        if sizes[key] < 1:
            raise ValueError(f"{key} must be >= 1, got {sizes[key]}")
    kwargs = {key: sizes[key] for key in ("dims", "timed_steps", "train_steps", "bandwidths_gbps", "comm_dtype")}
    kwargs["batch_size"] = sizes["batch"]
    return launch(experiment_rank, world_size, backend=profile().backend_for(world_size), timeout_s=timeout_s,
                  ranks_per_node=ranks_per_node,
                  weight_bits=weight_bits, grad_bits=grad_bits, block_size=block_size, **kwargs)


def deepspeed_zero3_rank(
    dims: tuple[int, ...],
    steps: int,
    configs: dict[str, dict[str, Any]],
    ranks_per_node: int = 2,
    batch_size: int = 4,
    seed: int = 0,
) -> dict[str, Any]:
    """Rank function: DeepSpeed's own ZeRO-3 engine with ZeRO++ flags, bytes split by node.

    ``configs`` maps a label to extra ``zero_optimization`` keys (e.g.
    ``{"zero_hpz_partition_size": 2}``). DeepSpeed binds torch's collectives when
    it initialises, so the counter is entered before ``init_distributed`` and
    reset before each engine's training steps.
    """
    import deepspeed

    layout = NodeLayout.for_world(dist.get_world_size(), ranks_per_node)
    device = _device()
    out: dict[str, Any] = {}
    with NodeAwareCounter(layout) as counter:
        deepspeed.init_distributed(dist_backend=rank_info().backend)
        teacher = init_flat(dims, flat_numel(dims), seed + 1000).to(device)
        for label, extra in configs.items():
            torch.manual_seed(seed)
            layers: list[torch.nn.Module] = []
            for i, (fan_in, fan_out) in enumerate(zip(dims[:-1], dims[1:])):
                layers += [torch.nn.Linear(fan_in, fan_out)] + ([torch.nn.ReLU()] if i < len(dims) - 2 else [])
            config = {
                "train_micro_batch_size_per_gpu": batch_size,
                "bf16": {"enabled": device.type == "cuda"},
                "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
                "zero_optimization": {"stage": 3, "reduce_bucket_size": 2**20, "stage3_prefetch_bucket_size": 2**20,
                                      "stage3_param_persistence_threshold": 0, **extra},
            }
            engine, *_ = deepspeed.initialize(model=torch.nn.Sequential(*layers), config=config)
            counter.reset()
            counter.intra.reset()
            losses = []
            for step in range(steps):
                x, y = batch(dims, teacher, batch_size, seed=step * 1000 + dist.get_rank())
                # On GPUs the engine's weights are bf16 and DeepSpeed does not cast inputs.
                x = x.to(torch.bfloat16) if device.type == "cuda" else x
                loss = F.mse_loss(engine(x).float(), y)
                engine.backward(loss)
                engine.step()
                losses.append(_mean_over_ranks(loss.item()))
            out[label] = {
                "cross_node_bytes_per_step": counter.cross_node_bytes() / steps,
                "intra_node_bytes_per_step": counter.intra_node_bytes() / steps,
                "cross_node_ops": {op: c.calls for op, c in counter.counts.items() if c.calls},
                "intra_node_ops": {op: c.calls for op, c in counter.intra.counts.items() if c.calls},
                "loss": losses,
                "num_params": sum(p.ds_numel for p in engine.module.parameters()),
            }
            engine.destroy()
    return out


DEEPSPEED_SIZES = {
    "ci": {"dims": (256, 512, 512, 256), "steps": 3},
    "gpu": {"dims": (256, 512, 512, 256), "steps": 3},
    "multi-gpu": {"dims": (1024, 2048, 2048, 1024), "steps": 10},
}


def deepspeed_configs(on_gpus: bool, ranks_per_node: int) -> dict[str, dict[str, Any]]:
    """ZeRO-3 beside DeepSpeed's ZeRO++ flags; the quantized ones need CUDA kernels (PLATFORM-NOTES)."""
    configs: dict[str, dict[str, Any]] = {"ZeRO-3": {}, "hpZ": {"zero_hpz_partition_size": ranks_per_node}}
    if on_gpus:
        configs["qwZ"] = {"zero_quantized_weights": True}
        configs["qgZ"] = {"zero_quantized_gradients": True}
        configs["ZeRO++"] = {"zero_quantized_weights": True, "zero_hpz_partition_size": ranks_per_node,
                             "zero_quantized_gradients": True}
    return configs


def run_deepspeed(world_size: int = 4, ranks_per_node: int = 2, *, timeout_s: float = 600.0) -> dict[str, Any]:
    """DeepSpeed's ZeRO-3 engine with its ZeRO++ flags on real ranks; only hpZ on CPU ranks."""
    from labkit import dsops
    from labkit.launcher import launch
    from labkit.profiles import profile

    layout = NodeLayout.for_world(world_size, ranks_per_node)
    if layout.nodes < 2:
        raise ValueError(f"need at least 2 nodes, got world_size={world_size}, ranks_per_node={ranks_per_node}")
    prof = profile()
    backend = prof.backend_for(world_size)
    on_gpus = backend == "nccl"
    # Built here, once, not by every rank inside the launch timeout.
    dsops.ensure_built((dsops.COMM_OP, dsops.QUANTIZER_OP) if on_gpus else (dsops.COMM_OP,),
                       accelerator=dsops.accelerator_for(backend))
    sizes = prof.pick(DEEPSPEED_SIZES)
    results = launch(deepspeed_zero3_rank, world_size, backend=backend, timeout_s=timeout_s,
                     dims=sizes["dims"], steps=sizes["steps"], ranks_per_node=ranks_per_node,
                     configs=deepspeed_configs(on_gpus, ranks_per_node))
    return results[0]
