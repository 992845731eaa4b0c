"""ZeRO-3 and ZeRO++ training steps on real ranks: labkit's own implementation.

Each rank keeps only its fp32 master shard of a small MLP (ZeRO-3). A step
all-gathers the weights for the forward pass, frees them (their storage is
really released, as ZeRO-3 and FSDP do), all-gathers them again for the
backward pass, then reduce-scatters the gradients so each rank updates its own
shard. ``Variant`` switches on ZeRO++'s qwZ, hpZ and qgZ one by one or together
(``labkit.quantcomm`` holds the collectives). The ranks are mapped onto nodes
(``NodeLayout``, e.g. 2 nodes x 2 ranks). ``labkit.zeropp_fabric`` runs these
steps on a miniature cluster with real shaped links (or, without one, under
``NodeAwareCounter``'s emulated link) and measures them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit.collectives import LINKS, CommCounter, Link
from labkit.launcher import rank_device
from labkit.quantcomm import (
    NodeLayout,
    all_gather_plain,
    all_gather_quantized,
    check_bits,
    check_block_size,
    error_bound_per_element,
    reduce_scatter_plain,
    reduce_scatter_quantized,
    zero_step_comm_bytes,
)


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
        self.device = rank_device()
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
        per_rank = self.numel // dist.get_world_size(self.node_group)
        local = dist.get_rank(self.node_group)
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


def _mean_over_ranks(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=rank_device())
    dist.all_reduce(tensor)
    return tensor.item() / dist.get_world_size()


@dataclass(frozen=True)
class GradientError:
    """qgZ's reduced gradients against the exact fp32 ones, as norms relative to the exact gradient.

    ``relative_bound`` is the guaranteed worst case (every element off by its
    blocks' half-steps at once); ``within_bound_everywhere`` checks that guarantee
    element by element, which a norm alone could hide.
    """

    relative_error: float
    relative_bound: float
    within_bound_everywhere: bool


def gradient_error(job: ZeroRank, x: torch.Tensor, y: torch.Tensor) -> GradientError:
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
    return GradientError(
        relative_error=error.norm().item() / exact.norm().item(),
        relative_bound=bound.norm().item() / exact.norm().item(),
        within_bound_everywhere=bool((error <= bound + tolerance).all().item()),
    )


@dataclass(frozen=True)
class StepTraffic:
    """The calculator's answer: one step's cross-node GB, the same as a multiple of M, and the link's seconds."""

    cross_node_gb: float
    multiple_of_M: float
    link_s: float


def traffic_calculator(
    params_billion: float,
    *,
    bandwidth_gbps: float,
    param_bytes: int = 2,
    qwz: bool = False,
    hpz: bool = False,
    qgz: bool = False,
) -> StepTraffic:
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
    return StepTraffic(
        cross_node_gb=traffic.total / 1e9,
        multiple_of_M=traffic.total / model,
        link_s=traffic.total * 8 / (bandwidth_gbps * 1e9),
    )



def traffic_text(params_billion: float, bandwidth_gbps: float, qwz: bool, hpz: bool, qgz: bool) -> str:
    """The calculator's line: cross-node GB per step, as a multiple of M, and the link's seconds."""
    r = traffic_calculator(params_billion, bandwidth_gbps=bandwidth_gbps, qwz=qwz, hpz=hpz, qgz=qgz)
    return f"{r.cross_node_gb:.1f} GB cross-node per step ({r.multiple_of_M:.2f}M), {r.link_s:.2f} s on the link"


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
