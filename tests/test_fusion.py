"""Fusion: same result, fewer bytes; the model predicts the ratio."""

import pytest
import torch

from labkit import fusion


def test_fused_chain_moves_three_times_fewer_bytes_than_four_kernels():
    prediction = fusion.predict(1024, 1024, "float32")
    n = 1024 * 1024
    assert prediction.unfused_bytes == (9 * n + 1024) * 4
    assert prediction.fused_bytes == (3 * n + 1024) * 4
    assert prediction.byte_ratio == pytest.approx(3.0, rel=1e-3)


def test_bytes_scale_with_dtype_but_the_ratio_does_not():
    fp32, bf16 = fusion.predict(256, 512, "float32"), fusion.predict(256, 512, "bf16")
    assert bf16.fused_bytes == fp32.fused_bytes / 2
    assert bf16.byte_ratio == pytest.approx(fp32.byte_ratio)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_tiled_fused_chain_equals_the_unfused_chain(workers):
    x, residual = torch.randn(37, 64), torch.randn(37, 64)
    bias = torch.randn(64)
    expected = fusion.unfused_chain(x, bias, residual, 0.5, torch.empty_like(x), torch.empty_like(x))
    got = fusion.tiled_fused_chain(x, bias, residual, 0.5, torch.empty_like(x), tile_rows=5, workers=workers)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(fusion.eager_chain(x, bias, residual, 0.5), expected)


def test_tile_fits_the_tile_budget():
    rows = fusion.tile_rows_for(4096, "float32")
    assert rows * 4096 * 4 <= fusion.TILE_BYTES
    assert fusion.tile_rows_for(10**9, "float32") == 1


def test_compare_measures_all_three_forms_on_small_data():
    result = fusion.compare("cpu", fusion.FusionSizes(rows=256, hidden=512, dtype="float32", method="tiled", repeats=2))
    assert min(result.eager_ms, result.unfused_ms, result.fused_ms) > 0
    assert result.method == "tiled"
    assert result.prediction.byte_ratio == pytest.approx(3.0, rel=0.01)


def test_agreement_needs_the_right_direction_and_rough_ratio():
    prediction = fusion.FusionPrediction(unfused_bytes=9.0, fused_bytes=3.0)
    assert fusion.FusionResult("tiled", prediction, 0, unfused_ms=30, fused_ms=12).agrees
    assert not fusion.FusionResult("tiled", prediction, 0, unfused_ms=30, fused_ms=31).agrees
    assert not fusion.FusionResult("tiled", prediction, 0, unfused_ms=30, fused_ms=1).agrees


def test_bad_method_and_sizes_are_refused():
    with pytest.raises(ValueError, match="method must be one of"):
        fusion.fused_chain("triton-by-hand", 64, "float32")
    with pytest.raises(ValueError, match="tile_rows and workers must be >= 1"):
        x = torch.zeros(2, 2)
        fusion.tiled_fused_chain(x, x[0], x, 1.0, x, tile_rows=0)
    with pytest.raises(ValueError, match="must be a positive integer"):
        fusion.predict(0, 8)


def test_compile_falls_back_to_the_tiled_form_without_a_compiler(monkeypatch):
    monkeypatch.setattr(fusion.shutil, "which", lambda name: None)
    assert fusion.compiler_missing("cpu")
    assert fusion.pick_method("compile", "cpu") == "tiled"
    assert fusion.pick_method("tiled", "cpu") == "tiled"
    with pytest.raises(ValueError, match="method must be one of"):
        fusion.pick_method("by-hand", "cpu")


def test_interleaved_timing_returns_the_best_of_each():
    from labkit.devices import interleaved_best_ms

    calls = []
    best = interleaved_best_ms({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                               warmup=0, repeats=3)
    assert calls == ["a", "b"] * 3 and set(best) == {"a", "b"}
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        interleaved_best_ms({"a": lambda: None}, repeats=0)


def test_fused_chain_moves_fewer_bytes_at_every_profile_size():
    for sizes in fusion.SIZES.values():
        prediction = fusion.predict(sizes.rows, sizes.hidden, sizes.dtype)
        assert prediction.fused_bytes < prediction.unfused_bytes
