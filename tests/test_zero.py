"""labkit.zero: the ZeRO memory model reproduces the paper and refuses bad sizes."""

import dataclasses

import pytest

from labkit import zero

PSI = 7_500_000_000


def test_zero_paper_worked_example_7_5b_params_on_64_gpus():
    gb = [zero.model_state_bytes(PSI, stage, 64).total / 1e9 for stage in zero.STAGES]
    assert [round(x, 1) for x in gb] == [120.0, 31.4, 16.6, 1.9]


def test_stage0_is_16_bytes_per_param_on_every_rank():
    states = zero.model_state_bytes(1000, 0, 8)
    assert states.as_dict() == {"params": 2000, "grads": 2000, "optimizer": 12000, "total": 16000}


def test_zero3_optimizer_state_per_rank_is_one_over_n():
    for n in (2, 4, 64):
        assert zero.model_state_bytes(1024 * n, 3, n).optimizer == 12 * 1024


def test_each_stage_partitions_one_more_state():
    whole = zero.model_state_bytes(4096, 0, 4)
    s1, s2, s3 = (zero.model_state_bytes(4096, s, 4) for s in (1, 2, 3))
    assert (s1.params, s1.grads, s1.optimizer) == (whole.params, whole.grads, whole.optimizer // 4)
    assert (s2.params, s2.grads) == (whole.params, whole.grads // 4)
    assert s3.total == whole.total // 4


def test_partitions_round_up_like_padded_flat_buffers():
    assert zero.partition_numel(10, 4) == 3
    assert zero.model_state_bytes(10, 3, 4).params == 6


def test_result_is_frozen_and_indexable_by_key():
    states = zero.model_state_bytes(100, 1, 2)
    assert states["total"] == states.total == states.params + states.grads + states.optimizer
    assert dict(states.as_dict()) == {k: states[k] for k in states}
    with pytest.raises(dataclasses.FrozenInstanceError):
        states.params = 0
    with pytest.raises(KeyError, match="key must be one of"):
        states["activations"]


def test_byte_widths_are_parameters_of_the_model():
    fp32_adam = zero.model_state_bytes(10, 0, 1, param_bytes=4, grad_bytes=4, optimizer_bytes=8)
    assert fp32_adam.total == 160


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_params=10, stage=4, dp_degree=2), "stage must be one of 0, 1, 2, 3"),
        (dict(num_params=10, stage=-1, dp_degree=2), "stage must be one of 0, 1, 2, 3"),
        (dict(num_params=10, stage=1, dp_degree=0), "dp_degree must be >= 1, got 0"),
        (dict(num_params=-1, stage=1, dp_degree=2), "num_params must be >= 0, got -1"),
        (dict(num_params=10, stage=1, dp_degree=2, grad_bytes=-2), "grad_bytes must be >= 0"),
    ],
)
def test_bad_sizes_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        zero.model_state_bytes(**kwargs)


def test_optimizer_offload_moves_optimizer_state_off_the_accelerator():
    placed = zero.offload_placement(1000, 2, 4, optimizer_target="cpu")
    on_rank = zero.model_state_bytes(1000, 2, 4)
    assert placed.accelerator.optimizer == 0
    assert placed.cpu.optimizer == on_rank.optimizer
    assert placed.accelerator.params == on_rank.params
    assert placed.accelerator.total + placed.offloaded.total == on_rank.total


def test_zero_offload_moves_4_bytes_per_param_over_pcie_per_step_on_one_gpu():
    placed = zero.offload_placement(1000, 2, 1, optimizer_target="cpu")
    assert placed.pcie_bytes_per_step == 4000
    assert placed.accelerator.total == 2000


def test_param_offload_fetches_params_for_forward_and_backward():
    both = zero.offload_placement(1000, 3, 2, optimizer_target="cpu", param_target="cpu")
    assert both.accelerator.total == 0
    assert both.pcie_bytes_per_step == 500 * (2 + 2 + 2)


def test_nvme_offload_reads_and_writes_state_every_step():
    placed = zero.offload_placement(1000, 3, 1, optimizer_target="nvme", param_target="nvme")
    assert placed.nvme.optimizer == 12000 and placed.nvme.params == 2000
    assert placed.nvme_bytes_per_step == 2 * 12000 + 3 * 2000


def test_offload_refuses_stages_that_do_not_partition_the_state():
    with pytest.raises(ValueError, match="param_target='cpu' needs stage 3"):
        zero.offload_placement(10, 2, 2, param_target="cpu")
    with pytest.raises(ValueError, match="needs stage >= 1"):
        zero.offload_placement(10, 0, 2, optimizer_target="cpu")
    with pytest.raises(ValueError, match="optimizer_target must be one of"):
        zero.offload_placement(10, 2, 2, optimizer_target="disk")


def test_largest_model_fits_and_one_more_parameter_does_not():
    device = 80 * 2**30
    for stage in zero.STAGES:
        best = zero.largest_model_params(device, stage, 8)
        assert zero.model_state_bytes(best, stage, 8).total <= device
        assert zero.model_state_bytes(best + 1, stage, 8).total > device


def test_each_stage_fits_a_larger_model():
    sizes = [zero.largest_model_params(32 * 2**30, s, 64) for s in zero.STAGES]
    assert sizes == sorted(sizes) and sizes[3] > 50 * sizes[0]


def test_zero_offload_fits_13b_params_on_one_32gb_v100():
    assert zero.largest_model_params(32 * 10**9, 2, 1, optimizer_target="cpu") >= 13e9
    assert zero.largest_model_params(32 * 10**9, 0, 1) < 13e9


def test_fully_offloaded_model_has_no_accelerator_bound():
    with pytest.raises(ValueError, match="every model state offloaded"):
        zero.largest_model_params(2**30, 3, 2, optimizer_target="cpu", param_target="cpu")
    with pytest.raises(ValueError, match="device_bytes must be >= 0"):
        zero.largest_model_params(-1, 3, 2)


def test_calculator_says_whether_it_fits():
    roomy = zero.calculator_view(7.5e9, 64, 3, "none", 80)
    tight = zero.calculator_view(7.5e9, 64, 0, "none", 80)
    assert roomy.fits and not tight.fits
    assert roomy.labels == ("params", "grads", "optimizer")
    assert sum(tight.accelerator_gib) == pytest.approx(120e9 / 2**30)
    assert "does NOT fit" in tight.message


def test_calculator_offload_shows_the_moved_bytes_and_the_traffic():
    view = zero.calculator_view(13e9, 1, 2, "optimizer -> CPU", 32)
    assert view.fits and view.accelerator_gib[2] == 0 and view.offloaded_gib[2] > 0
    assert view.pcie_gib_per_step == pytest.approx(4 * 13e9 / 2**30)
    upgraded = zero.calculator_view(1e9, 4, 1, "optimizer + params -> CPU", 80)
    assert "needs stage 3" in upgraded.message and sum(upgraded.accelerator_gib) == 0


def test_calculator_refuses_unknown_offload_and_empty_device():
    with pytest.raises(ValueError, match="offload must be one of"):
        zero.calculator_view(1e9, 4, 1, "tape", 80)
    with pytest.raises(ValueError, match="device_gib must be > 0"):
        zero.calculator_view(1e9, 4, 1, "none", 0)


def test_zero3_on_64_gpus_holds_one_64th_of_plain_data_parallelism():
    assert zero.model_state_bytes(PSI, 3, 64).total * 64 == zero.model_state_bytes(PSI, 0, 64).total
