"""A tensor-parallel MLP on real ranks (Megatron-LM, arXiv 1909.08053), its collectives counted.

Tensor parallelism splits each layer's matrices across ranks and all-reduces
*activations* inside every layer, forward and backward: heavy, so it stays on the
fast links inside a node. The layer below splits the first matrix by columns and
the second by rows, so each MLP needs one all-reduce forward and one backward;
:func:`tensor_parallel_rank` checks its output and gradients against the unsplit
layer and counts the calls with :class:`labkit.collectives.CommCounter`. The
planner that decides where to use it is :mod:`labkit.parallelism`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labkit.collectives import CommCounter, OpCount
from labkit.profiles import require_at_least


class _CopyToTensorParallel(torch.autograd.Function):
    """Forward: identity (every rank already holds the input). Backward: all-reduce the input gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Forward: all-reduce the partial sums of the row-split matmul. Backward: identity."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class TensorParallelMLP(nn.Module):
    """Megatron's MLP split over the ranks of ``group``: one all-reduce forward, one backward.

    The first matrix is split by output columns (each rank computes a slice of the
    hidden activations, no communication), the second by input rows (each rank
    produces a partial sum of the output, all-reduced). Built from a full
    ``nn.Sequential(Linear, GELU, Linear)`` so results can be checked against it.
    """

    def __init__(self, full: nn.Sequential, group: Any = None):
        super().__init__()
        self.group = group
        tp = dist.get_world_size(group)
        rank = dist.get_rank(group)
        first, second = full[0], full[2]
        if first.out_features % tp:
            raise ValueError(f"ffn width {first.out_features} must be divisible by the tensor-parallel degree {tp}")
        width = first.out_features // tp
        cols = slice(rank * width, (rank + 1) * width)
        self.w1 = nn.Parameter(first.weight.detach()[cols].clone())
        self.b1 = nn.Parameter(first.bias.detach()[cols].clone())
        self.w2 = nn.Parameter(second.weight.detach()[:, cols].clone())
        self.b2 = nn.Parameter(second.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _CopyToTensorParallel.apply(x, self.group)
        hidden = nn.functional.gelu(nn.functional.linear(x, self.w1, self.b1))
        partial = nn.functional.linear(hidden, self.w2)
        return _ReduceFromTensorParallel.apply(partial, self.group) + self.b2


def full_mlp(hidden: int, ffn: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))


@dataclass(frozen=True)
class TensorParallelSizes:
    """``layers`` residual MLPs ``hidden`` -> ``ffn`` -> ``hidden`` on ``tokens`` tokens; ``ffn`` is what is split."""

    hidden: int
    ffn: int
    tokens: int
    layers: int

    def __post_init__(self) -> None:
        require_at_least(self, 1, "hidden", "ffn", "tokens", "layers")


TP_SIZES = {
    "ci": TensorParallelSizes(hidden=256, ffn=1024, tokens=64, layers=3),
    "gpu": TensorParallelSizes(hidden=256, ffn=1024, tokens=64, layers=3),
    # ffn splits evenly across any node of 2-8 GPUs (8400 = 840 x 10, 840 = lcm(1..8)).
    "multi-gpu": TensorParallelSizes(hidden=2048, ffn=8400, tokens=1024, layers=4),
}


@dataclass(frozen=True)
class TensorParallelRun:
    """One rank's view of a tensor-parallel forward and backward, beside the unsplit layers' results."""

    counts: dict[str, OpCount]
    """The collectives the rank issued, per op (forward and backward)."""
    forward_all_reduce_calls: int
    max_output_error: float
    max_input_grad_error: float
    activation_bytes: int
    """One all-reduce's message: the tokens x hidden activations."""
    layers: int
    world_size: int
    shard_params: int
    full_params: int

    def describe(self) -> str:
        return (f"{self.world_size} ranks, {self.layers} layers: all_reduce {self.counts['all_reduce']} "
                f"({self.forward_all_reduce_calls} in the forward pass); max output error "
                f"{self.max_output_error:.1e}, input gradient {self.max_input_grad_error:.1e}; "
                f"{self.shard_params:,} of {self.full_params:,} parameters per rank")


def tensor_parallel_rank(hidden: int, ffn: int, tokens: int, layers: int) -> TensorParallelRun:
    """Rank function: forward+backward through ``layers`` TP MLPs, counted, checked against the full model.

    Every rank builds the same full layers (same seeds), keeps its shard, and
    compares output and input gradient with the unsplit computation.
    """
    from labkit.launcher import rank_device

    device = rank_device()
    fulls = [full_mlp(hidden, ffn, seed=layer).to(device) for layer in range(layers)]
    shards = [TensorParallelMLP(full).to(device) for full in fulls]
    torch.manual_seed(1234)
    x = torch.randn(tokens, hidden, device=device)

    x_ref = x.clone().requires_grad_(True)
    y_ref = x_ref
    for full in fulls:
        y_ref = y_ref + full(y_ref)
    y_ref.square().mean().backward()

    x_tp = x.clone().requires_grad_(True)
    with CommCounter() as counter:
        y_tp = x_tp
        for shard in shards:
            y_tp = y_tp + shard(y_tp)
        forward_calls = counter.counts["all_reduce"].calls
        y_tp.square().mean().backward()
    return TensorParallelRun(
        counts=dict(counter.counts),
        forward_all_reduce_calls=forward_calls,
        max_output_error=(y_tp - y_ref).abs().max().item(),
        max_input_grad_error=(x_tp.grad - x_ref.grad).abs().max().item(),
        activation_bytes=tokens * hidden * x.element_size(),
        layers=layers,
        world_size=dist.get_world_size(),
        shard_params=sum(p.numel() for p in shards[0].parameters()),
        full_params=sum(p.numel() for p in fulls[0].parameters()),
    )


def run_tensor_parallel(world_size: int = 2, sizes: TensorParallelSizes | None = None) -> TensorParallelRun:
    """Launch :func:`tensor_parallel_rank` on real ranks; returns rank 0's result."""
    from labkit.launcher import launch
    from labkit.profiles import profile

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    chosen = sizes or profile().pick(TP_SIZES)
    if chosen.ffn % world_size:
        raise ValueError(f"ffn ({chosen.ffn}) must be divisible by world_size ({world_size})")
    return launch(tensor_parallel_rank, world_size, backend=profile().backend_for(world_size), **asdict(chosen))[0]
