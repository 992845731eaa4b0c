"""The small models the labs train: a stack of Linear layers.

Labs 5, 7 and 8 measure what a model's size costs (gradient bytes on a link,
checkpoint bytes on disk, a step's time), never what its architecture learns,
so one shape serves them all; each lab picks the widths that give it the bytes
it needs.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


def mlp(widths: Sequence[int], *, activation: type[nn.Module] = nn.ReLU, seed: int | None = None) -> nn.Sequential:
    """Linear layers from ``widths[0]`` through each width to ``widths[-1]``, ``activation`` between them.

    ``seed`` makes the initial weights reproducible (ranks that must start equal pass the same one).
    """
    widths = list(widths)
    if len(widths) < 2 or any(width < 1 for width in widths):
        raise ValueError(f"widths must be two or more sizes >= 1 (input, ..., output), got {widths}")
    if seed is not None:
        torch.manual_seed(seed)
    blocks: list[nn.Module] = []
    for fan_in, fan_out in zip(widths, widths[1:]):
        blocks += [nn.Linear(fan_in, fan_out), activation()]
    return nn.Sequential(*blocks[:-1])


def parameter_count(widths: Sequence[int]) -> int:
    """Weights and biases of :func:`mlp` with these widths, without building it."""
    return sum(fan_in * fan_out + fan_out for fan_in, fan_out in zip(widths, widths[1:]))
