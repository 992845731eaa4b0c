"""Reference answers to Lab 6's exercises."""

import torch

from labkit.exercises import Answer

EX_6_1 = Answer(
    right=lambda numel, bits, block_size: numel * bits / 8 + numel / block_size * 4,
    wrong=lambda numel, bits, block_size: numel * bits / 8,
    wrong_because="the codes alone: every block also sends its fp32 scale",
)


def _round_trip(x: torch.Tensor, bits: int, block_size: int, *, per_block: bool = True) -> torch.Tensor:
    """Symmetric codes -q..q with q = 2**(bits-1) - 1, one absmax scale per block (or per tensor)."""
    q = 2 ** (bits - 1) - 1
    blocks = x.reshape(-1, block_size)
    absmax = blocks.abs().amax(dim=1, keepdim=True) if per_block else blocks.abs().max().expand(len(blocks), 1)
    step = absmax.clamp_min(1e-30) / q
    return (torch.round(blocks / step) * step).reshape(-1)


EX_6_2 = Answer(
    right=_round_trip,
    wrong=lambda x, bits, block_size: _round_trip(x, bits, block_size, per_block=False),
    wrong_because="one scale for the whole tensor: blocks 1000x smaller than the largest round to zero",
)
