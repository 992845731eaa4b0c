"""What Lab 5's ranks train: the MLP, its synthetic data and the sizes, shared by DDP and DeepSpeed.

:mod:`labkit.gradsync` (DDP, sync every micro-step or once per window),
:mod:`labkit.gradsync_deepspeed` (DeepSpeed's collectives per ZeRO stage) and
:mod:`labkit.gradsync_crossover` (the window at which two ranks beat one) train the
same model on the same data, so their measurements compare; they import it from
here, and none of them imports another's internals.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from labkit.models import mlp
from labkit.profiles import require_at_least


def check_accumulation(accumulation: int) -> None:
    if not isinstance(accumulation, int) or accumulation < 1:
        raise ValueError(f"accumulation must be an integer >= 1, got {accumulation!r}")


@dataclasses.dataclass(frozen=True)
class GradSyncSizes:
    """A ``layers``-deep MLP of width ``hidden``, trained ``optimizer_steps`` times (after ``warmup_steps``)
    on windows of ``accumulation`` micro-batches of ``micro_batch`` samples."""

    hidden: int
    layers: int
    micro_batch: int
    accumulation: int
    optimizer_steps: int
    warmup_steps: int

    def __post_init__(self) -> None:
        check_accumulation(self.accumulation)
        require_at_least(self, 1, "hidden", "layers", "micro_batch", "optimizer_steps")
        require_at_least(self, 0, "warmup_steps")

    def batches(self, rank: int, step: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One accumulation window of this rank's data for ``step`` (:func:`micro_batches`)."""
        return micro_batches(rank, step, self.accumulation, self.micro_batch, self.hidden, device)


def make_model(hidden: int, layers: int, seed: int = 0) -> nn.Sequential:
    """``layers`` Linear layers of ``hidden`` x ``hidden``: parameters (so gradient bytes) grow as layers x hidden^2."""
    if hidden < 1 or layers < 1:
        raise ValueError(f"hidden and layers must be >= 1, got {hidden}, {layers}")
    return mlp([hidden] * (layers + 1), seed=seed)


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def micro_batches(
    rank: int, step: int, accumulation: int, micro_batch: int, hidden: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Synthetic regression data, different on every rank and step (each rank sees its own shard)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    out = []
    for _ in range(accumulation):
        x = torch.randn(micro_batch, hidden, generator=gen)
        out.append((x.to(device), x.flip(1).to(device)))
    return out
