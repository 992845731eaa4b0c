"""Microbenchmarks: small sizes, checked for physics rather than speed."""

import pytest
import torch

from labkit import intensity_sweep, microbench, reference_loops, roofline

TINY = microbench.MicrobenchSizes(
    bandwidth_numel=2**20,
    matmul_n={"float32": 128, "float64": 64},
    op_numel_rows=256,
    op_numel_cols=256,
    matmul_sweep=(8, 64),
    op_dtype="float32",
    repeats=2,
    intensity_elements=2**16,
    intensity_widths=(1, 4, 16),
)


@pytest.fixture(scope="module")
def peaks():
    return microbench.measure_peaks("cpu", TINY)


def test_peak_bandwidth_is_the_best_stream_kernel(peaks):
    kernels = peaks.bandwidth.by_kernel_bytes_per_s
    assert set(kernels) == {"copy", "scale", "add", "triad"}
    assert peaks.bandwidth_bytes_per_s == max(kernels.values()) > 0


def test_measured_matmul_peaks_are_per_dtype_and_give_a_ridge(peaks):
    assert set(peaks.matmul_flops_per_s) == {"float32", "float64"}
    assert peaks.ridge("float32") == pytest.approx(peaks.matmul_flops_per_s["float32"] / peaks.bandwidth_bytes_per_s)
    spec = peaks.as_spec()
    assert spec.source.startswith("measured")


def test_every_op_carries_the_model_cost_and_a_positive_time():
    measured = microbench.measure_ops("cpu", TINY).ops
    names = [m.cost.name for m in measured]
    assert names[:5] == ["residual add", "relu", "softmax", "layer_norm", microbench.ALLOCATING_ADD]
    assert all(m.ms > 0 for m in measured)
    add = measured[0]
    assert add.bytes_per_s == pytest.approx(add.cost.bytes_moved / (add.ms / 1e3))
    assert add.as_row()["FLOP/byte"] == pytest.approx(1 / 12, abs=0.01)


def test_memory_bound_ops_are_those_below_the_ridge():
    measured = microbench.measure_ops("cpu", TINY).ops
    memory_bound = microbench.memory_bound_ops(measured, ridge=5.0)
    assert {m.cost.name for m in memory_bound} >= {"residual add", "relu", "softmax", "layer_norm"}
    assert all(m.cost.intensity < 5.0 for m in memory_bound)


def test_tf32_switch_is_restored_after_measuring():
    before = torch.backends.cuda.matmul.allow_tf32
    with microbench.matmul_precision("tf32"):
        assert torch.backends.cuda.matmul.allow_tf32
    assert torch.backends.cuda.matmul.allow_tf32 == before


def test_plain_references_measure_positive_rates():
    assert reference_loops.plain_matmul_flops("cpu", 64, iterations=2) > 0
    assert reference_loops.plain_copy_bytes_per_s("cpu", 2**16, iterations=2) > 0


def test_unsupported_dtype_and_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="dtype must be one of"):
        microbench.measure_matmul_flops("cpu", 8, "float8")
    with pytest.raises(ValueError, match="must be a positive integer"):
        microbench.measure_bandwidth("cpu", 0)
    with pytest.raises(ValueError, match="must be a positive integer"):
        microbench.measure_matmul_flops("cpu", 0)
    assert roofline.dtype_name(torch.float16) == "float16"


def test_the_intensity_sweep_moves_the_same_bytes_at_rising_flops():
    sweep = intensity_sweep.measure("cpu", "float32", TINY, rounds=2)
    intensities = [p.cost.intensity for p in sweep.points]
    assert intensities == sorted(intensities) and len(intensities) == len(TINY.intensity_widths)
    moved = [p.cost.bytes_moved for p in sweep.points]
    assert max(moved) < 1.5 * min(moved), "M x K is fixed: about the same bytes each call"
    assert sweep.peak_flops_per_s >= max(p.flops_per_s for p in sweep.points)
    assert sweep.bandwidth_bytes_per_s > 0
    with pytest.raises(ValueError, match="rounds must be >= 1, got 0"):
        intensity_sweep.measure("cpu", "float32", TINY, rounds=0)


def test_crossover_is_the_first_intensity_at_half_the_peak_and_roof_beaters_are_flagged():
    def point(intensity, ms):   # intensity * 1e6 FLOPs over 1e6 bytes in ms
        return microbench.OpMeasurement(roofline.OpCost("op", intensity * 1e6, 1e6, "float32"), ms)

    sweep = intensity_sweep.IntensitySweep([point(1, 100.0), point(10, 100.0), point(100, 100.0)],
                                      peak_flops_per_s=1e9, bandwidth_bytes_per_s=1e8)
    assert sweep.ridge == 10
    assert sweep.crossover_intensity() == 100      # 1e7, 1e8, 1e9 FLOP/s: only the last reaches 5e8
    assert sweep.climb() == pytest.approx(100)
    assert sweep.earliest_crossover() == pytest.approx(5 / 1.65)  # half the ridge, less write-allocate and noise
    early = intensity_sweep.IntensitySweep([point(4, 10 / 1.4), point(100, 100.0)], 1e9, 1e8)  # 1.4x the roof at 4
    assert early.over_memory_roof() == [] and early.earliest_crossover() <= early.crossover_intensity() == 4
    assert sweep.over_memory_roof() == []
    beater = point(1, 1.0)                         # 1e9 FLOP/s at intensity 1: 10x the memory roof
    assert intensity_sweep.IntensitySweep([beater], 1e9, 1e8).over_memory_roof() == [beater]
    streamed = point(1, 100 / 1.4)                 # 1.4x the roof: a kernel whose writes skip write-allocate
    assert intensity_sweep.IntensitySweep([streamed], 1e9, 1e8).over_memory_roof() == []
    assert intensity_sweep.IntensitySweep([point(1, 100.0)], 1e10, 1e8).crossover_intensity() == float("inf")
    with pytest.raises(ValueError, match="share must be in"):
        sweep.crossover_intensity(0)
    with pytest.raises(ValueError, match="share must be in"):
        sweep.earliest_crossover(1.5)


def test_a_point_is_its_median_round_so_one_quiet_moment_does_not_put_it_over_the_roof(monkeypatch):
    rounds_ms = [1.0, 10.0, 9.0]   # each point's rounds: one quiet moment, two typical ones
    times: dict[int, list[float]] = {}

    def timed(device, chosen, width, dtype):
        times.setdefault(width, []).append(rounds_ms[len(times[width])])
        return times[width][-1]

    monkeypatch.setattr(intensity_sweep, "_time_skinny_matmul", timed)
    sweep = intensity_sweep.measure("cpu", "float32", TINY, rounds=3)
    assert [p.ms for p in sweep.points] == [9.0] * len(TINY.intensity_widths)


def test_the_roof_matmul_does_at_least_the_widest_points_flops_on_a_blocking_multiple():
    assert intensity_sweep.square_size_for(2 * 1024**3) == 1024
    assert intensity_sweep.square_size_for(2 * 1025**3) == 1280
    assert intensity_sweep.square_size_for(8.6e9) == 1792      # CI's widest point: 2 x 16384 x 512 x 512


def test_the_memory_roof_keeps_the_best_measurement_and_every_experiment_can_raise_it(monkeypatch):
    roof = microbench.MemoryRoof(2**16, repeats=1)
    with pytest.raises(ValueError, match="not been measured yet"):
        roof.bytes_per_s
    found = iter([3e9, 5e9, 4e9])
    monkeypatch.setattr(microbench, "measure_bandwidth", lambda device, numel, dtype, *, repeats: (
        microbench.BandwidthResult({"copy": next(found)}, numel, dtype)))
    assert [roof.measure("cpu") for _ in range(3)] == [3e9, 5e9, 5e9]
    assert roof.measurements == 3
    with pytest.raises(ValueError, match="numel and repeats must be >= 1"):
        microbench.MemoryRoof(0)


def test_ops_and_the_sweep_measure_the_one_roof_in_turns_with_their_points():
    roof = microbench.MemoryRoof(TINY.bandwidth_numel, repeats=1)
    microbench.measure_ops("cpu", TINY, roof, rounds=2)
    assert roof.measurements == 2
    sweep = intensity_sweep.measure("cpu", "float32", TINY, rounds=2, roof=roof)
    assert roof.measurements == 4 and sweep.bandwidth_bytes_per_s == roof.bytes_per_s


def test_an_ops_share_of_the_roof_is_taken_against_the_stream_run_of_its_own_round(monkeypatch):
    """STREAM swings between rounds; the op's share is its rate over the same round's roof, median of rounds."""
    roofs = iter([10e9, 40e9, 10e9])   # one fast STREAM round, as a shared host gave
    monkeypatch.setattr(microbench, "measure_bandwidth", lambda device, numel, dtype, *, repeats: (
        microbench.BandwidthResult({"copy": next(roofs)}, numel, dtype)))
    monkeypatch.setattr(microbench, "best_ms", lambda fn, device, repeats: 1.0)
    timed = microbench.measure_ops("cpu", TINY, rounds=3)
    relu = next(m for m in timed.ops if m.cost.name == "relu")
    assert timed.share("relu") == pytest.approx(relu.bytes_per_s / 10e9)   # the median round, not the fast one
    with pytest.raises(ValueError, match="name must be one of the timed ops"):
        timed.share("gelu")


def test_the_preallocated_ops_compute_what_their_usual_forms_do():
    def result(fn):
        out = fn()
        return (out[0] if isinstance(out, tuple) else out).clone()

    got = {cost.name: result(fn) for cost, fn in microbench.transformer_ops("cpu", TINY).ops[:5]}
    assert torch.equal(got["residual add"], got[microbench.ALLOCATING_ADD])
    assert (got["relu"] >= 0).all() and (got["relu"] == 0).any()
    assert torch.allclose(got["softmax"].sum(dim=-1), torch.ones(TINY.op_numel_rows))
    assert torch.allclose(got["layer_norm"].mean(dim=-1), torch.zeros(TINY.op_numel_rows), atol=1e-5)


def test_stream_kernels_under_other_names_can_raise_the_roof(monkeypatch):
    monkeypatch.setattr(microbench, "measure_bandwidth", lambda device, numel, dtype, *, repeats: (
        microbench.BandwidthResult({"add": 4e9}, numel, dtype)))
    roof = microbench.MemoryRoof(2**16, repeats=1)
    roof.measure("cpu")
    assert roof.include("residual add", 4.4e9) == 4.4e9 and roof.by_kernel_bytes_per_s["residual add"] == 4.4e9
    assert roof.include("relu", 3e9) == 4.4e9
    with pytest.raises(ValueError, match="name must be one of"):
        roof.include("softmax", 5e9)
