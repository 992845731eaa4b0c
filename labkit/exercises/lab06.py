"""Lab 6's exercises: the bytes a quantized message puts on the wire; a blockwise quantizer, as code."""

from __future__ import annotations

from typing import Callable

import torch

from labkit import quantcomm
from labkit.exercises import Verdict, check_code, predict

RoundTrip = Callable[[torch.Tensor, int, int], torch.Tensor]


def wire_bytes(prediction, *, numel: int = 1_000_000, bits: int = 4, block_size: int = 128) -> Verdict | None:
    """Exercise 6.1: bytes of the buffer a quantized collective sends for ``numel`` fp32 values."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))

    def measure() -> float:
        return quantcomm.to_wire(quantcomm.quantize_blockwise(x, bits=bits, block_size=block_size)).numel()

    def explain(measured: float) -> str:
        codes = numel * bits // 8
        return (f"{numel:,} codes of {bits} bits = {codes:,} bytes, plus one fp32 scale per block of "
                f"{block_size}: {measured - codes:,.0f} bytes ({(measured - codes) / measured:.1%} of the message). "
                f"Against {4 * numel:,} bytes of fp32: {measured / (4 * numel):.3f}x.")

    return predict("6.1", prediction, what=f"the bytes on the wire for {numel:,} values at {bits} bits, blocks of "
                   f"{block_size}", measure=measure, context=(numel, bits, block_size), tolerance=0.01,
                   unit="bytes", explain=explain)


def round_trip(answer, *, bits: int = 4, block_size: int = 256) -> bool | None:
    """Exercise 6.2: ``quantize_then_restore(x, bits, block_size)``, checked for error and for codes."""
    generator = torch.Generator().manual_seed(1)
    blocks = torch.randn(64, block_size, generator=generator)
    # gradients of different layers differ in scale by orders of magnitude: so do these blocks
    x = (blocks * 10.0 ** torch.arange(64).remainder(4).unsqueeze(1)).reshape(-1)
    bound = quantcomm.error_bound_per_element(x, bits=bits, block_size=block_size)

    def test(rule: RoundTrip) -> str | None:
        restored = torch.as_tensor(rule(x.clone(), bits, block_size)).reshape(-1).float()
        if restored.shape != x.shape:
            return f"it returned {restored.numel()} values for {x.numel()}"
        distinct = max(torch.unique(block).numel() for block in restored.view(-1, block_size))
        if distinct > 2 ** bits:
            return f"a block holds {distinct} distinct values: {bits} bits can name at most {2 ** bits}"
        worst = ((restored - x).abs() / bound).max().item()
        if worst > 1 + 1e-4:
            return (f"an element is off by {worst:.1f}x half a step of an absmax scale for its block; one scale "
                    "for a whole tensor whose blocks differ in size crushes the small blocks")
        return None

    return check_code("6.2", answer, what="a function quantize_then_restore(x, bits, block_size) -> tensor",
                      test=test)
