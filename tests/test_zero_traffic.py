"""ZeRO's communication per step: the paper's ring volumes, and the same collectives at a backend's measured price."""

import pytest

from labkit import zero_traffic

PSI = 1_000_000


@pytest.mark.parametrize("ranks", [2, 4, 64])
def test_stage_3_sends_one_and_a_half_times_stage_2_and_stages_1_2_as_much_as_stage_0(ranks):
    sent = {s: zero_traffic.modelled_bytes_per_rank(PSI, s, ranks, 2) for s in (0, 1, 2, 3)}
    assert sent[0] == sent[1] == sent[2]
    assert sent[3] == pytest.approx(1.5 * sent[2])
    assert sent[0] == pytest.approx(2 * (ranks - 1) / ranks * 2 * PSI)


def test_bucket_all_reduces_and_a_reduce_scatter_priced_as_an_all_reduce_make_stage_3_four_thirds_of_stage_2():
    gloo = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 1.0}  # measured on this box
    sent = {s: zero_traffic.modelled_bytes_per_rank(PSI, s, 2, 2, gloo) for s in (0, 2, 3)}
    assert sent[2] == pytest.approx(1.5 * sent[0])
    assert sent[3] / sent[2] == pytest.approx(4 / 3)


def test_a_slow_step_lies_between_full_overlap_and_none():
    low, high = zero_traffic.modelled_step_ms_range(100.0, 1.25e6, 0.1)
    assert zero_traffic.link_ms(1.25e6, 0.1) == pytest.approx(100.0)
    assert (low, high) == pytest.approx((100.0, 200.0))


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="stage"):
        zero_traffic.modelled_bytes_per_rank(PSI, 4, 2, 2)
    with pytest.raises(ValueError, match="bytes_per_elem"):
        zero_traffic.modelled_bytes_per_rank(PSI, 3, 2, 0)
    with pytest.raises(ValueError, match="gbit"):
        zero_traffic.link_ms(1.0, 0.0)
    with pytest.raises(ValueError, match="slow_gbit"):
        zero_traffic.TrafficSize(slow_gbit=0, timed_steps=1)
