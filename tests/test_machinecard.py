"""The machine card's arithmetic: which component bounds a step for a model and batch."""

import pytest

from labkit.course.machinecard import MachineCard, bottlenecks, storage_write_bytes_per_s

CARD = MachineCard(device="cpu", matmul_flops_per_s=1e12, memory_bytes_per_s=1e10,
                   host_to_device_bytes_per_s=None, allreduce_busbw_bytes_per_s=1e9,
                   storage_write_bytes_per_s=1e9, decode_images_per_s=1000, machine={})


def test_a_big_model_on_a_slow_link_is_bound_by_gradient_sync():
    slowest = bottlenecks(CARD, num_params=10**9, batch_size=1, ranks=8)[0]
    assert slowest.lab == 5 and slowest.seconds == pytest.approx(2.0)


def test_a_small_model_with_a_big_batch_is_bound_by_decoding():
    slowest = bottlenecks(CARD, num_params=1000, batch_size=4096, ranks=2, loader_cores=2)[0]
    assert slowest.lab == 1 and slowest.seconds == pytest.approx(2.048)


def test_one_rank_has_no_gradient_sync():
    sync = [e for e in bottlenecks(CARD, num_params=10**6, batch_size=8, ranks=1) if e.lab == 5][0]
    assert sync.seconds == 0.0


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="must all be >= 1"):
        bottlenecks(CARD, num_params=0, batch_size=8)


def test_storage_write_rate_is_measured_on_real_files(tmp_path):
    assert storage_write_bytes_per_s(tmp_path, 2**20) > 0
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="nbytes must be >= 1"):
        storage_write_bytes_per_s(tmp_path, 0)
