"""The roofline cost model: pure functions, checked against arithmetic and the speaker's figures."""

import pytest
import torch

from labkit import roofline, roofline_devices


def test_elementwise_add_moves_three_arrays_and_does_one_flop_per_element():
    cost = roofline.elementwise(1000, "float32", inputs=2)
    assert cost.flops == 1000
    assert cost.bytes_moved == 3 * 1000 * 4
    assert cost.intensity == pytest.approx(1 / 12)


def test_bf16_halves_the_bytes_and_doubles_the_intensity_of_fp32():
    fp32 = roofline.matmul(512, 512, 512, "float32")
    bf16 = roofline.matmul(512, 512, 512, torch.bfloat16)
    assert bf16.flops == fp32.flops
    assert bf16.bytes_moved == fp32.bytes_moved / 2
    assert bf16.intensity == pytest.approx(2 * fp32.intensity)


def test_matmul_counts_two_flops_per_multiply_add_and_each_operand_once():
    cost = roofline.matmul(8, 16, 32, "bf16", batch=3)
    assert cost.flops == 2 * 3 * 8 * 16 * 32
    assert cost.bytes_moved == 3 * (8 * 32 + 32 * 16 + 8 * 16) * 2


def test_square_matmul_intensity_grows_linearly_with_size():
    sizes = [64, 128, 256, 512, 1024, 2048]
    intensities = [roofline.square_matmul_intensity(n, "bfloat16") for n in sizes]
    assert all(a < b for a, b in zip(intensities, intensities[1:]))
    assert intensities[-1] / intensities[0] == pytest.approx(sizes[-1] / sizes[0])


@pytest.mark.parametrize("device", sorted(roofline_devices.VENDOR_SPECS))
def test_matmul_intensity_crosses_the_ridge_on_every_device(device):
    spec = roofline_devices.device_spec(device)
    ridge = spec.ridge("bfloat16")
    assert roofline.square_matmul_intensity(64, "bfloat16") < ridge < roofline.square_matmul_intensity(8192, "bfloat16")


@pytest.mark.parametrize("device", sorted(roofline_devices.VENDOR_SPECS))
def test_elementwise_softmax_and_layernorm_sit_far_below_every_ridge(device):
    spec = roofline_devices.device_spec(device)
    for cost in (roofline.elementwise(2**20, "bf16", inputs=2), roofline.softmax(1024, 1024, "bf16"),
                 roofline.layer_norm(1024, 4096, "bf16"), roofline.reduction(1024, 4096, "bf16")):
        assert cost.intensity < spec.ridge("bfloat16") / 50
        assert roofline_devices.place(cost, spec).bound == "memory-bound"


def test_ridge_points_reproduce_fregly_figures_from_the_datasheets():
    assert roofline_devices.device_spec("A100").ridge("bf16") == pytest.approx(153, rel=0.02)
    assert roofline_devices.device_spec("H100").ridge("bf16") == pytest.approx(295, rel=0.02)


def test_h200_has_h100_compute_but_more_bandwidth_so_a_lower_ridge():
    h100, h200 = roofline_devices.device_spec("H100"), roofline_devices.device_spec("h200")
    assert h200.peak("bf16") == h100.peak("bf16")
    assert h200.ridge("bf16") < h100.ridge("bf16")


def test_every_vendor_row_says_it_is_a_vendor_figure():
    assert all(spec.source.startswith("vendor figure") for spec in roofline_devices.VENDOR_SPECS.values())


def test_attainable_is_bandwidth_times_intensity_below_the_ridge_and_peak_above():
    peak, bandwidth = 100e12, 2e12
    assert roofline.attainable_flops_per_s(10, peak, bandwidth) == 20e12
    assert roofline.attainable_flops_per_s(1000, peak, bandwidth) == peak
    assert roofline.ridge_point(peak, bandwidth) == 50


def test_min_time_is_the_slower_of_compute_and_memory():
    cost = roofline.OpCost("x", flops=1e12, bytes_moved=1e9, dtype="float32")
    assert roofline.min_time_s(cost, 1e12, 1e12) == pytest.approx(1.0)
    assert roofline.min_time_s(cost, 1e15, 1e8) == pytest.approx(10.0)


def test_host_cpu_row_is_an_estimate_from_cores_clock_and_isa_not_a_vendor_figure():
    spec = roofline_devices.host_cpu_spec(10e9, cores=2, ghz=2.5, flags={"avx2", "fma"})
    assert spec.peak("float32") == 2 * 2.5e9 * 32
    assert spec.peak("float64") == spec.peak("float32") / 2
    assert "not a vendor figure" in spec.source
    assert "host CPU" in roofline_devices.spec_table(spec)


def test_explorer_calls_a_small_batch_matmul_memory_bound_and_a_large_one_compute_bound():
    small = roofline_devices.explore("H100", batch=1, seq_len=1, hidden=4096)
    large = roofline_devices.explore("H100", batch=8, seq_len=2048, hidden=4096)
    assert small["MLP matmul"].bound == "memory-bound"
    assert large["MLP matmul"].bound == "compute-bound"
    assert large["residual add"].bound == "memory-bound"
    assert "compute-bound" in roofline_devices.explorer_text("B200", 8, 2048, 4096)


def test_explorer_widget_builds_and_prints_the_verdict():
    view = roofline_devices.explorer_widget()
    assert "memory-bound" in view()


def test_unknown_device_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"device must be one of .*A100"):
        roofline_devices.device_spec("TPU v9")
    with pytest.raises(ValueError, match="device must be one of"):
        roofline_devices.explore("V100", batch=1, seq_len=1, hidden=64)


@pytest.mark.parametrize("shape", [(0, 4, 4), (4, -1, 4), (4, 4, 2.5)])
def test_non_positive_shapes_are_refused(shape):
    with pytest.raises(ValueError, match="must be a positive integer"):
        roofline.matmul(*shape)


def test_unsupported_dtypes_are_refused_by_name():
    with pytest.raises(ValueError, match=r"dtype must be one of"):
        roofline.elementwise(10, "int4")
    with pytest.raises(ValueError, match=r"dtype must be one of"):
        roofline.matmul(2, 2, 2, torch.complex64)
    with pytest.raises(ValueError, match="has no peak figure"):
        roofline_devices.device_spec("A100").peak("float8")


def test_bad_roof_figures_are_refused():
    with pytest.raises(ValueError, match="must be > 0"):
        roofline.ridge_point(0, 1e9)
    with pytest.raises(ValueError, match="intensity must be > 0"):
        roofline.attainable_flops_per_s(0, 1e12, 1e9)


@pytest.mark.parametrize("gpu_name, row", [
    ("NVIDIA H100 80GB HBM3", "H100"),
    ("NVIDIA H200", "H200"),
    ("NVIDIA A100-SXM4-80GB", "A100"),
])
def test_the_exact_sxm_device_names_get_their_vendor_row(gpu_name, row):
    assert roofline_devices.match_vendor_spec(gpu_name) is roofline_devices.VENDOR_SPECS[row]


@pytest.mark.parametrize("gpu_name", [
    "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200 NVL", "NVIDIA A100 80GB PCIe",
    "NVIDIA A100-SXM4-40GB", "NVIDIA GeForce RTX 4090", "Tesla V100-SXM2-32GB",
])
def test_other_variants_of_a_family_get_no_vendor_row_so_the_measured_roof_is_used(gpu_name):
    assert roofline_devices.match_vendor_spec(gpu_name) is None


def test_every_known_device_name_points_at_an_existing_vendor_row():
    assert set(roofline_devices.VENDOR_DEVICE_NAMES.values()) <= set(roofline_devices.VENDOR_SPECS)


@pytest.mark.parametrize("device", sorted(roofline_devices.VENDOR_SPECS))
def test_lab3_memory_ops_sit_at_least_5x_below_the_ridge_in_every_dtype_a_vendor_row_lists(device):
    spec = roofline_devices.device_spec(device)
    for dtype in spec.peak_flops_per_s:
        for cost in (roofline.elementwise(2**24, dtype, inputs=2), roofline.softmax(4096, 4096, dtype),
                     roofline.layer_norm(8192, 4096, dtype)):
            assert cost.intensity < spec.ridge(dtype) / 5, (dtype, cost.name)


def test_lab3_explorer_decoding_one_token_is_memory_bound_and_a_training_batch_compute_bound_at_hidden_8192():
    assert roofline_devices.explore("H100", batch=1, seq_len=1, hidden=8192)["MLP matmul"].bound == "memory-bound"
    assert roofline_devices.explore("H100", batch=8, seq_len=4096, hidden=8192)["MLP matmul"].bound == "compute-bound"
