"""Quantized collectives: ZeRO++'s three ways to move fewer bytes across nodes.

ZeRO-3 moves the model three times per step (Lab 4): an all-gather of the
weights for the forward pass, another for the backward pass (the gathered
weights were freed in between) and a reduce-scatter of the gradients. With
small micro-batches there is little compute to hide that traffic behind, so the
slowest link (between nodes) sets the step time. ZeRO++ (Wang et al., arXiv
2306.10209) cuts the cross-node bytes three ways, each paid for with something:

* **qwZ** all-gathers weights as int8 codes with one scale per block: half the
  bytes of fp16/bf16, paid for with precision.
* **hpZ** keeps a secondary copy of the gathered weights partitioned *inside
  each node*, so the backward all-gather never crosses a node boundary: paid for
  with memory (one node-share of the model per rank).
* **qgZ** replaces the gradient reduce-scatter with an all-to-all of int4 codes
  that every rank dequantizes *before* summing (summing int4 codes would
  overflow and mix scales): a quarter of the bytes, paid for with precision.

This module holds the pieces: blockwise quantization, the node layout that
tells cross-node groups from intra-node ones, the collectives, and the volume
model (pure functions). ``labkit.zeropp`` runs them in a ZeRO-3-style training
step on real ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

SUPPORTED_BITS = (2, 4, 8)
SCALE_BYTES = 4
"""Scales are stored as fp32: one per block, and counted in every byte figure."""


def check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")


def check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")


def qmax(bits: int) -> int:
    """Largest code of symmetric ``bits``-bit quantization (codes span -qmax..qmax)."""
    check_bits(bits)
    return 2 ** (bits - 1) - 1


def padded_numel(numel: int, *, bits: int, block_size: int) -> int:
    """Elements after padding to whole blocks and whole bytes of packed codes."""
    check_bits(bits)
    check_block_size(block_size)
    unit = math.lcm(block_size, 8 // bits)
    return -(-numel // unit) * unit


def quantized_bytes(numel: int, *, bits: int, block_size: int | None, scale_bytes: int = SCALE_BYTES) -> int:
    """Bytes on the wire for ``numel`` values: packed codes plus one scale per block.

    ``block_size=None`` counts the codes only (the paper's idealised figure).
    """
    check_bits(bits)
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if block_size is None:
        return -(-numel * bits // 8)
    padded = padded_numel(numel, bits=bits, block_size=block_size)
    return padded * bits // 8 + padded // block_size * scale_bytes


@dataclass(frozen=True)
class Quantized:
    """Blockwise symmetric codes: ``codes`` packs 8/bits values per byte; one fp32 scale per block."""

    codes: torch.Tensor
    scales: torch.Tensor
    numel: int
    bits: int
    block_size: int

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()


def quantize_blockwise(x: torch.Tensor, *, bits: int = 8, block_size: int = 256) -> Quantized:
    """Quantize ``x`` (flattened) with one absmax scale per block of ``block_size`` values.

    Per-block scales keep one outlier from crushing the resolution of the whole
    tensor; symmetric codes need no zero point because weights and gradients
    are centred on zero.
    """
    check_bits(bits)
    check_block_size(block_size)
    flat = x.detach().reshape(-1).float()
    padded = padded_numel(flat.numel(), bits=bits, block_size=block_size)
    if padded != flat.numel():
        flat = torch.nn.functional.pad(flat, (0, padded - flat.numel()))
    blocks = flat.view(-1, block_size)
    absmax = blocks.abs().amax(dim=1)
    top = qmax(bits)
    inverse = torch.where(absmax > 0, top / absmax, torch.zeros_like(absmax))
    # x * top/absmax lies in [-top, top]; shifting by top + 0.5 and truncating rounds to nearest
    unsigned = torch.mul(blocks, inverse.unsqueeze(1)).add_(top + 0.5).to(torch.uint8)
    return Quantized(_pack(unsigned.view(-1), bits), absmax / top, x.numel(), bits, block_size)


def dequantize_blockwise(q: Quantized) -> torch.Tensor:
    """fp32 values back from codes and scales (the inverse of ``quantize_blockwise``, up to rounding)."""
    unsigned = _unpack(q.codes, q.bits).view(-1, q.block_size)
    scales = q.scales.unsqueeze(1)
    values = torch.mul(unsigned, scales).sub_(scales * qmax(q.bits))
    return values.view(-1)[: q.numel]


def _pack(unsigned: torch.Tensor, bits: int) -> torch.Tensor:
    per_byte = 8 // bits
    if per_byte == 1:
        return unsigned
    lanes = unsigned.view(-1, per_byte)
    packed = lanes[:, 0].clone()
    for lane in range(1, per_byte):
        packed.bitwise_or_(lanes[:, lane] << (bits * lane))
    return packed


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    per_byte = 8 // bits
    if per_byte == 1:
        return packed
    mask = 2**bits - 1
    lanes = [(packed >> (bits * lane)) & mask for lane in range(per_byte)]
    return torch.stack(lanes, dim=1).view(-1)


def relative_error(x: torch.Tensor, *, bits: int, block_size: int = 256) -> float:
    """||dequant(quant(x)) - x|| / ||x||: the precision a bit width costs."""
    restored = dequantize_blockwise(quantize_blockwise(x, bits=bits, block_size=block_size))
    return (restored - x.reshape(-1).float()).norm().item() / x.float().norm().item()


def error_bound_per_element(x: torch.Tensor, *, bits: int, block_size: int = 256) -> torch.Tensor:
    """Worst-case |error| per element: half a quantization step of its block."""
    q = quantize_blockwise(x, bits=bits, block_size=block_size)
    half_step = (q.scales / 2).repeat_interleave(block_size)
    return half_step[: x.numel()]


def to_wire(q: Quantized) -> torch.Tensor:
    """Codes and scales as one uint8 buffer, so each quantized collective is one call."""
    return torch.cat([q.codes, q.scales.view(torch.uint8)])


def from_wire(buffer: torch.Tensor, numel: int, *, bits: int, block_size: int) -> Quantized:
    padded = padded_numel(numel, bits=bits, block_size=block_size)
    code_bytes = padded * bits // 8
    scales = buffer[code_bytes:].clone().view(torch.float32)
    return Quantized(buffer[:code_bytes], scales, numel, bits, block_size)


# ---------------------------------------------------------------- node layout


@dataclass(frozen=True)
class NodeLayout:
    """Ranks mapped onto nodes in blocks: node ``i`` holds ranks ``i*k .. i*k+k-1``.

    Collectives on a group inside one node use the fast intra-node fabric;
    groups that span nodes pay for the slow link (the one the emulation slows).
    """

    nodes: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if not isinstance(self.nodes, int) or self.nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {self.nodes!r}")
        if not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node!r}")

    @classmethod
    def for_world(cls, world_size: int, ranks_per_node: int) -> "NodeLayout":
        """The layout for ``world_size`` ranks, or a ValueError if they do not tile whole nodes."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size!r}")
        if not isinstance(ranks_per_node, int) or ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node!r}")
        if world_size % ranks_per_node:
            raise ValueError(
                f"world_size must be a multiple of ranks_per_node={ranks_per_node} "
                f"(whole nodes), got {world_size}"
            )
        return cls(world_size // ranks_per_node, ranks_per_node)

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def node_of(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        return rank // self.ranks_per_node

    def node_ranks(self, node: int) -> list[int]:
        return list(range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node))

    def spans_nodes(self, ranks: list[int]) -> bool:
        return len({self.node_of(r) for r in ranks}) > 1


def node_groups(layout: NodeLayout) -> tuple[object, list[int]]:
    """Inside a rank: (this rank's intra-node process group, its ranks). Every rank must call it."""
    if dist.get_world_size() != layout.world_size:
        raise ValueError(f"layout has {layout.world_size} ranks, the job has {dist.get_world_size()}")
    mine = None, []
    for node in range(layout.nodes):
        ranks = layout.node_ranks(node)
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group, ranks
    return mine


# ---------------------------------------------------------------- collectives


def all_gather_plain(shard: torch.Tensor, *, group=None, comm_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Baseline: gather every rank's shard in ``comm_dtype``; fp32 result."""
    world = dist.get_world_size(group)
    out = torch.empty(shard.numel() * world, dtype=comm_dtype, device=shard.device)
    dist.all_gather_into_tensor(out, shard.detach().to(comm_dtype).contiguous(), group=group)
    return out.float()


def all_gather_quantized(
    shard: torch.Tensor, *, group=None, bits: int = 8, block_size: int = 256
) -> torch.Tensor:
    """qwZ: each rank quantizes its own shard, all ranks gather codes+scales, then dequantize."""
    world = dist.get_world_size(group)
    _check_aligned(shard.numel(), bits=bits, block_size=block_size, what="shard numel")
    wire = to_wire(quantize_blockwise(shard, bits=bits, block_size=block_size))
    out = torch.empty(wire.numel() * world, dtype=torch.uint8, device=shard.device)
    dist.all_gather_into_tensor(out, wire, group=group)
    parts = [
        dequantize_blockwise(from_wire(piece, shard.numel(), bits=bits, block_size=block_size))
        for piece in out.view(world, -1)
    ]
    return torch.cat(parts)


def reduce_scatter_plain(full: torch.Tensor, *, group=None, comm_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Baseline: sum every rank's ``full`` and keep this rank's shard, in ``comm_dtype``; fp32 result."""
    world = dist.get_world_size(group)
    out = torch.empty(full.numel() // world, dtype=comm_dtype, device=full.device)
    dist.reduce_scatter_tensor(out, full.detach().to(comm_dtype).contiguous(), group=group)
    return out.float()


def reduce_scatter_quantized(
    full: torch.Tensor, *, group=None, bits: int = 4, block_size: int = 256
) -> torch.Tensor:
    """qgZ: all-to-all of quantized chunks, then dequantize *before* the reduction.

    Rank r receives every rank's chunk r as codes with their own scales; it
    dequantizes each to fp32 and sums there. (A reduce-scatter on the codes
    would add values quantized with different scales and overflow int4.)
    This is the one-hop variant; ZeRO++ goes intra-node first, then across.
    """
    world = dist.get_world_size(group)
    if full.numel() % world:
        raise ValueError(f"full numel must be a multiple of the group size {world}, got {full.numel()}")
    chunk = full.numel() // world
    _check_aligned(chunk, bits=bits, block_size=block_size, what="chunk numel")
    wire = to_wire_chunks(quantize_blockwise(full, bits=bits, block_size=block_size), world)
    received = torch.empty_like(wire)
    dist.all_to_all_single(received, wire, group=group)
    total = torch.zeros(chunk, dtype=torch.float32, device=full.device)
    for piece in received.view(world, -1):
        total += dequantize_blockwise(from_wire(piece, chunk, bits=bits, block_size=block_size))
    return total


def to_wire_chunks(q: Quantized, chunks: int) -> torch.Tensor:
    """Per-destination wire buffers (codes then scales of each chunk), concatenated in rank order."""
    codes = q.codes.view(chunks, -1)
    scales = q.scales.view(chunks, -1).view(torch.uint8)
    return torch.cat([codes, scales], dim=1).view(-1)


def _check_aligned(numel: int, *, bits: int, block_size: int, what: str) -> None:
    if padded_numel(numel, bits=bits, block_size=block_size) != numel:
        unit = math.lcm(block_size, 8 // bits)
        raise ValueError(f"{what} must be a multiple of {unit} (block_size={block_size}, bits={bits}), got {numel}")


# ---------------------------------------------------------------- volume model


@dataclass(frozen=True)
class StepCommBytes:
    """Cross-node bytes of one training step, by phase: one rank's in the paper's accounting
    (:func:`zero_step_comm_bytes`), one node uplink's on a fabric (:func:`labkit.zeropp_model.uplink_payload_model`)."""

    forward_allgather: float
    backward_allgather: float
    grad_reduce_scatter: float

    @property
    def total(self) -> float:
        return self.forward_allgather + self.backward_allgather + self.grad_reduce_scatter


def zero_step_comm_bytes(
    num_params: int,
    *,
    param_bytes: int = 2,
    qwz: bool = False,
    hpz: bool = False,
    qgz: bool = False,
    weight_bits: int = 8,
    grad_bits: int = 4,
    block_size: int | None = None,
    scale_bytes: int = SCALE_BYTES,
    world_size: int | None = None,
) -> StepCommBytes:
    """ZeRO-3 / ZeRO++ cross-node traffic per rank per step (Wang et al., table of volumes).

    With the defaults it is the paper's accounting: M = ``num_params * param_bytes``;
    ZeRO-3 moves M + M + M = 3M, qwZ halves both all-gathers (int8 vs 16-bit),
    hpZ removes the backward all-gather from the cross-node link, qgZ quarters the
    gradient traffic (int4): all three give 0.5M + 0 + 0.25M = 0.75M.
    ``block_size`` adds the per-block scales; ``world_size`` applies the ring
    factor (N-1)/N, which is what a rank really sends on N ranks.
    """
    if num_params < 0:
        raise ValueError(f"num_params must be >= 0, got {num_params}")
    if param_bytes < 1:
        raise ValueError(f"param_bytes must be >= 1, got {param_bytes}")
    if world_size is not None and world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    check_bits(weight_bits)
    check_bits(grad_bits)
    if block_size is not None:
        check_block_size(block_size)
    ring = 1.0 if world_size is None else (world_size - 1) / world_size
    model_bytes = num_params * param_bytes
    weights = quantized_bytes(num_params, bits=weight_bits, block_size=block_size, scale_bytes=scale_bytes) if qwz else model_bytes
    grads = quantized_bytes(num_params, bits=grad_bits, block_size=block_size, scale_bytes=scale_bytes) if qgz else model_bytes
    return StepCommBytes(
        forward_allgather=ring * weights,
        backward_allgather=0.0 if hpz else ring * weights,
        grad_reduce_scatter=ring * grads,
    )


def hpz_extra_bytes_per_rank(num_params: int, *, ranks_per_node: int, param_bytes: int = 2) -> float:
    """Memory hpZ adds to each rank: its share of the node's secondary copy of the weights."""
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
    return num_params * param_bytes / ranks_per_node


def zero3_param_bytes_per_rank(num_params: int, *, world_size: int, param_bytes: int = 2) -> float:
    """ZeRO-3's own weight shard per rank, to set hpZ's extra memory against."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return num_params * param_bytes / world_size
