"""Lab 6: where ZeRO++'s speedup comes from (micro-batch, link time over compute), on made-up measurements."""

import pytest

from labkit import zeropp, zeropp_model, zeropp_speedup
from labkit.fabric import LinkBytes
from labkit.quantcomm import NodeLayout

RATES = (0.5, 1.0, 4.0)
WIRE = {"ZeRO-3": 125_000_000, "ZeRO++": 25_000_000}
"""Busiest-link bytes per step: 1000 ms and 200 ms at 1 Gbit/s."""
COMPUTE_MS = {("ZeRO-3", 4): 100.0, ("ZeRO++", 4): 150.0, ("ZeRO-3", 2048): 1100.0, ("ZeRO++", 2048): 1150.0}


def _links(nbytes: int) -> dict[str, LinkBytes]:
    return {"node0": LinkBytes(tx_bytes=nbytes, rx_bytes=nbytes, tx_packets=0, rx_packets=0,
                               tx_wire_bytes=nbytes, rx_wire_bytes=nbytes)}


def _result(slow_big_zero3: float = 1.0) -> zeropp_model.FabricResult:
    """Steps that take exactly the model's time; ``slow_big_zero3`` stretches ZeRO-3's big-micro-batch steps."""
    timing = {}
    for (name, micro_batch), compute_ms in COMPUTE_MS.items():
        timing[name, micro_batch, zeropp_model.UNSHAPED_GBIT] = zeropp_model.StepTiming(compute_ms, (compute_ms,), 0.0)
        for gbit in RATES:
            ms = zeropp_model.step_time_model_ms(compute_ms, WIRE[name], gbit)
            ms *= slow_big_zero3 if (name, micro_batch) == ("ZeRO-3", 2048) else 1.0
            timing[name, micro_batch, gbit] = zeropp_model.StepTiming(ms, (ms,), 0.0)
    return zeropp_model.FabricResult(
        links="namespaces", links_reason="made up", num_params=1_000_000, layout=NodeLayout(nodes=2, ranks_per_node=2),
        rates_gbit=RATES, micro_batches=(4, 2048), weight_bits=8, grad_bits=4, block_size=256,
        link_bytes={name: _links(nbytes) for name, nbytes in WIRE.items()}, barrier_only=_links(0), timing=timing,
        grad_error=zeropp.GradientError(0.1, 0.2, True), hpz_secondary_bytes=0, primary_shard_bytes=0, loss={})


def test_a_bigger_micro_batch_shrinks_zeropps_gain_at_the_same_rate():
    effect = zeropp_speedup.micro_batch_effect(_result())
    assert effect.rate_gbit == 0.5 and (effect.small, effect.big) == (4, 2048)   # the slowest rate
    assert effect.speedup_small == pytest.approx(2100 / 550)
    assert effect.speedup_big == pytest.approx(3100 / 1550)
    assert effect.link_over_compute_small == pytest.approx(20.0) and effect.link_over_compute_big == pytest.approx(2000 / 1100)
    assert effect.ratio == pytest.approx(effect.model_ratio) and effect.ratio > zeropp_speedup.MICRO_BATCH_FLOOR
    assert "small over big" in effect.describe()
    assert "its gain at the small micro-batch" in " ".join(zeropp_speedup.micro_batch_sentences(effect))


def test_the_measured_ratio_moves_apart_from_the_model_when_the_big_steps_do():
    effect = zeropp_speedup.micro_batch_effect(_result(slow_big_zero3=2.0))
    assert effect.speedup_big == pytest.approx(2 * 3100 / 1550)
    assert effect.ratio < effect.model_ratio


def test_micro_batch_effect_refuses_an_untimed_rate_and_a_single_micro_batch():
    with pytest.raises(ValueError, match="rate_gbit must be one of the timed rates"):
        zeropp_speedup.micro_batch_effect(_result(), rate_gbit=2.0)
    one = _result()
    one = zeropp_model.FabricResult(**{**one.__dict__, "micro_batches": (4,)})
    with pytest.raises(ValueError, match="need two micro-batch sizes"):
        zeropp_speedup.micro_batch_effect(one)


def test_a_reported_speedup_implies_a_link_over_compute_ratio():
    x = zeropp_speedup.implied_link_over_compute(2.16, 0.25)
    assert x == pytest.approx(1.16 / 0.46)
    assert (1 + x) / (1 + 0.25 * x) == pytest.approx(2.16)
    assert zeropp_speedup.implied_link_over_compute(1.0, 0.25) == 0.0
    with pytest.raises(ValueError, match=r"speedup_x must be in \[1, 4\)"):
        zeropp_speedup.implied_link_over_compute(4.0, 0.25)
    with pytest.raises(ValueError, match=r"bytes_ratio must be in \(0, 1\)"):
        zeropp_speedup.implied_link_over_compute(2.0, 0.0)


def test_the_comparable_point_is_the_one_nearest_the_reported_ratio():
    result = _result()
    near = zeropp_speedup.nearest_point(result, 2.5)
    assert (near.micro_batch, near.rate_gbit) == (4, 4.0)  # ZeRO-3's link/compute 2.5 there
    assert near.link_over_compute == pytest.approx(2.5)
    assert near.speedup == pytest.approx(zeropp_model.speedup(result, 4)[2])
    far = zeropp_speedup.nearest_point(result, 20.0)
    assert (far.micro_batch, far.rate_gbit) == (4, 0.5)
    with pytest.raises(ValueError, match="link_over_compute_target must be > 0"):
        zeropp_speedup.nearest_point(result, 0.0)
