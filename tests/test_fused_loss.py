"""Lab 7: fusing the output projection into the loss removes the logits from memory."""

import pytest
import torch

from labkit.fused_loss import (
    IGNORE_INDEX,
    FusedLossSizes,
    fused_linear_cross_entropy,
    logits_bytes,
    loss_and_grads,
    make_inputs,
    measure_peak_memory,
    unfused_linear_cross_entropy,
)


@pytest.mark.parametrize("chunk_rows", [1, 7, 64, 1000])
def test_fused_loss_and_gradients_equal_the_unfused_ones(chunk_rows):
    h, w, t = make_inputs(48, 16, 500, seed=1)
    t[::5] = IGNORE_INDEX
    reference = [x.clone() for x in loss_and_grads("unfused", h, w, t)]
    fused = loss_and_grads("fused", h, w, t, chunk_rows)
    for expected, got in zip(reference, fused):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_fused_loss_scales_its_gradient_by_the_upstream_gradient():
    h, w, t = make_inputs(32, 8, 50)
    (3.0 * fused_linear_cross_entropy(h, w, t, chunk_rows=5)).backward()
    grad_fused = h.grad.clone()
    h.grad = None
    (3.0 * unfused_linear_cross_entropy(h, w, t)).backward()
    torch.testing.assert_close(grad_fused, h.grad, rtol=1e-5, atol=1e-6)


def test_fused_peak_memory_is_a_fraction_of_the_unfused_at_32k_vocab():
    """Measured in a fresh process (resident-set high-water mark): the unfused loss
    keeps three tokens x vocab matrices (logits, log-softmax, its gradient)."""
    sizes = FusedLossSizes(tokens=256, hidden=32, vocab=32768, chunk_rows=32)
    unfused, fused = measure_peak_memory(["unfused", "fused"], sizes)
    assert unfused.peak_bytes >= 2 * logits_bytes(256, 32768)
    assert fused.peak_bytes <= 0.5 * unfused.peak_bytes


def test_bad_shapes_and_chunks_are_refused():
    h, w, t = make_inputs(8, 4, 10)
    with pytest.raises(ValueError, match="chunk_rows must be"):
        fused_linear_cross_entropy(h, w, t, chunk_rows=0)
    with pytest.raises(ValueError, match="targets must have shape"):
        fused_linear_cross_entropy(h, w, t[:3])
    with pytest.raises(ValueError, match="hidden must be"):
        fused_linear_cross_entropy(h, w.T, t)
    with pytest.raises(ValueError, match="kind must be"):
        loss_and_grads("magic", h, w, t)


def test_a_fused_loss_size_table_with_empty_chunks_fails_when_built():
    with pytest.raises(ValueError, match=r"FusedLossSizes.chunk_rows must be >= 1, got 0"):
        FusedLossSizes(tokens=512, hidden=64, vocab=32768, chunk_rows=0)
