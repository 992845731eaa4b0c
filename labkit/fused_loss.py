"""Fused linear + cross-entropy: the loss without the batch x vocabulary matrix.

The last layer of a language model turns ``tokens x hidden`` activations into
``tokens x vocab`` logits. At a vocabulary of 32k-128k that matrix (and its
log-softmax and gradient, each the same size) is often the largest tensor in the
step. The unfused baseline materialises all of it; the fused version walks the
tokens in chunks and, for each chunk, computes logits, the loss and the gradients
with respect to the hidden states and the weight at once, keeping only
``chunk_rows x vocab`` alive. This is the idea of Liger Kernel's fused linear
cross-entropy (Hsu et al., arXiv 2410.10989), written in plain torch so that it
runs and can be measured on the CPU too; on a GPU the notebook also measures
Liger's Triton kernel when it is installed.

Gradients are computed in the forward pass (the chunk's logits are gone by the
backward), so the backward only scales them by the incoming gradient.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from labkit import fresh_process
from labkit.devices import peak_added_bytes
from labkit.profiles import require_at_least


@dataclass(frozen=True)
class FusedLossSizes:
    """``tokens`` hidden states of width ``hidden`` projected onto a ``vocab``-word vocabulary, fused
    ``chunk_rows`` tokens at a time: the full logits are ``tokens x vocab``, a chunk's ``chunk_rows x vocab``."""

    tokens: int
    hidden: int
    vocab: int
    chunk_rows: int

    def __post_init__(self) -> None:
        require_at_least(self, 1, "tokens", "hidden", "vocab", "chunk_rows")


SIZES = {
    "ci": FusedLossSizes(tokens=512, hidden=64, vocab=32768, chunk_rows=64),
    "gpu": FusedLossSizes(tokens=8192, hidden=2048, vocab=128256, chunk_rows=1024),
    "multi-gpu": FusedLossSizes(tokens=8192, hidden=2048, vocab=128256, chunk_rows=1024),
}
IGNORE_INDEX = -100


def unfused_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """The baseline: full ``tokens x vocab`` logits, then mean cross-entropy (in fp32)."""
    logits = hidden @ weight.T
    return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_rows: int, ignore_index: int):
        valid = targets != ignore_index
        count = valid.sum().clamp(min=1).to(torch.float32)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            h, t, v = hidden[rows], targets[rows], valid[rows]
            safe_t = torch.where(v, t, torch.zeros_like(t))
            logits = (h @ weight.T).float()
            lse = torch.logsumexp(logits, dim=-1)
            target_logit = logits.gather(1, safe_t[:, None]).squeeze(1)
            loss_sum += ((lse - target_logit) * v).sum()
            softmax = logits.sub_(lse[:, None]).exp_()
            softmax[torch.arange(len(t), device=t.device), safe_t] -= 1.0
            softmax.mul_((v / count)[:, None])
            grad_logits = softmax.to(hidden.dtype)
            grad_hidden[rows] = grad_logits @ weight
            grad_weight.addmm_(grad_logits.T.float(), h.float())
            del logits, softmax, grad_logits
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return loss_sum / count

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss, grad_weight * grad_loss, None, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_rows: int = 256,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets``, ``chunk_rows``
    tokens at a time: peak extra memory ~ ``chunk_rows x vocab``, not ``tokens x vocab``."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be (tokens, d) and weight (vocab, d); got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must have shape ({hidden.shape[0]},), got {tuple(targets.shape)}")
    if not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be an int >= 1, got {chunk_rows!r}")
    return _FusedLinearCrossEntropy.apply(hidden, weight, targets, chunk_rows, ignore_index)


def make_inputs(tokens: int, hidden: int, vocab: int, *, device="cpu", dtype=torch.float32, seed: int = 0):
    """Hidden states and an output projection that need gradients, plus targets."""
    for name, value in (("tokens", tokens), ("hidden", hidden), ("vocab", vocab)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen).to(device, dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) / hidden**0.5).to(device, dtype).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
    return h, w, t


def liger_available() -> bool:
    """Liger's kernels are Triton: they need a CUDA GPU and the liger-kernel package."""
    if not torch.cuda.is_available():
        return False
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _loss_fn(kind: str, chunk_rows: int):
    if kind == "unfused":
        return unfused_linear_cross_entropy
    if kind == "fused":
        return lambda h, w, t: fused_linear_cross_entropy(h, w, t, chunk_rows=chunk_rows)
    if kind == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        loss = LigerFusedLinearCrossEntropyLoss()
        return lambda h, w, t: loss(w, h, t)
    raise ValueError(f"kind must be 'unfused', 'fused' or 'liger', got {kind!r}")


def loss_and_grads(kind: str, h, w, t, chunk_rows: int = 256):
    """One forward + backward; returns (loss, grad_hidden, grad_weight)."""
    h.grad = w.grad = None
    loss = _loss_fn(kind, chunk_rows)(h, w, t)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _peak_bytes_here(kind: str, sizes: FusedLossSizes, device: str) -> int:
    """Peak memory one forward+backward adds, in this process, after a warm-up."""
    h, w, t = make_inputs(sizes.tokens, sizes.hidden, sizes.vocab, device=device)
    loss_and_grads(kind, h, w, t, sizes.chunk_rows)
    h.grad = w.grad = None
    return peak_added_bytes(lambda: loss_and_grads(kind, h, w, t, sizes.chunk_rows), device)


@dataclass(frozen=True)
class PeakMemory:
    kind: str
    peak_bytes: int
    method: str


def measure_peak_memory(kinds: list[str], sizes: FusedLossSizes, *, device: str = "cpu") -> list[PeakMemory]:
    """Peak memory added by one forward + backward of each loss.

    GPU: the caching allocator's own ``max_memory_allocated`` (exact).
    CPU: there is no allocator counter, so a fresh process with glibc's
    ``MALLOC_MMAP_THRESHOLD_`` fixed at 64 KiB (every large tensor is its own
    mapping, returned to the OS when freed) reads the kernel's resident-set
    high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``). That
    counts every page the call touched -- including the gradients both versions
    must return -- and nothing it did not.
    """
    if device.startswith("cuda"):
        return [PeakMemory(k, _peak_bytes_here(k, sizes, device), "torch.cuda.max_memory_allocated") for k in kinds]
    peaks = fresh_process.run_module("labkit.fused_loss", json.dumps({"kinds": kinds, "sizes": asdict(sizes)}),
                                     env=fresh_process.PEAK_ALLOCATOR_ENV, what="memory probe")
    return [PeakMemory(k, peaks[k], "resident-set high-water mark (VmHWM), fresh process") for k in kinds]


def logits_bytes(tokens: int, vocab: int, chunk_rows: int | None = None) -> int:
    """fp32 bytes of the logits matrix the loss keeps alive (all tokens, or one chunk)."""
    return 4 * vocab * (tokens if chunk_rows is None else min(tokens, chunk_rows))


def _main(argv: list[str]) -> None:
    spec = json.loads(argv[0])
    torch.set_num_threads(1)
    sizes = FusedLossSizes(**spec["sizes"])
    peaks = {kind: _peak_bytes_here(kind, sizes, "cpu") for kind in spec["kinds"]}
    print(json.dumps(peaks))


if __name__ == "__main__":
    # Run through the importable module, not this __main__ copy of it, so the probe
    # measures the same functions a notebook (or a test that patches them) uses.
    from labkit import fused_loss

    fused_loss._main(sys.argv[1:])
