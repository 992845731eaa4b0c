"""Lab 3's fused chain: fixed bytes, FLOPs dialled by the chain's length, points judged against the slope."""

import pytest
import torch

from labkit import fused_intensity as fi


def test_a_chain_of_k_multiply_adds_does_2k_flops_per_8_bytes():
    cost = fi.chain_cost(1000, 4)
    assert cost.flops == 8 * 1000 and cost.bytes_moved == 8 * 1000
    assert [fi.chain_cost(10, k).intensity for k in fi.CHAIN_LENGTHS] == [k / 4 for k in fi.CHAIN_LENGTHS]


def test_the_compiled_chain_computes_what_the_eager_one_does():
    x = torch.rand(4096)
    out = torch.empty_like(x)
    fi.compiled_chain(3)(x, out)
    expected = x
    for _ in range(3):
        expected = expected * 0.999 + 0.001
    torch.testing.assert_close(out, expected)
    with pytest.raises(ValueError, match="k must be >= 1"):
        fi.compiled_chain(0)


def test_only_points_well_below_the_ridge_are_judged_on_the_slope():
    # 10 GB/s and 40 GFLOP/s: ridge 4 FLOP/byte, so points up to 1 FLOP/byte lie on the slope
    costs = [fi.chain_cost(2**20, k) for k in (1, 4, 8)]
    sweep = fi.FusedSweep(costs, [[1.0], [0.5], [1.0]], round_roofs=[10e9], peak_flops_per_s=40e9)
    points = sweep.points
    assert sweep.ridge == pytest.approx(4.0)
    assert [p.cost.intensity for p in sweep.on_slope()] == [0.25, 1.0]
    # k=1 moved 8 MiB in 1 ms (8.4 GB/s): 0.84 of the slope; k=4 twice as fast: 1.68, above the roof
    assert sweep.of_slope(points[0]) == pytest.approx(8 * 2**20 / 1e-3 / 10e9)
    assert sweep.of_slope(points[1]) == pytest.approx(2 * sweep.of_slope(points[0]))


def test_each_round_is_set_against_the_roof_of_its_own_round():
    # the roof doubled in the second round and so did the chain: on the slope in both, whatever the best roof
    cost = fi.chain_cost(2**20, 1)
    ms = cost.flops / (0.25 * 10e9) * 1e3   # exactly intensity x 10 GB/s
    sweep = fi.FusedSweep([cost], [[ms, ms / 2, ms]], round_roofs=[10e9, 20e9, 10e9], peak_flops_per_s=40e9)
    assert sweep.of_slope(sweep.points[0]) == pytest.approx(1.0)
    assert sweep.bandwidth_bytes_per_s == 10e9 and sweep.points[0].ms == pytest.approx(ms)
    with pytest.raises(ValueError, match="round_ms must hold one time per round"):
        fi.FusedSweep([cost], [[ms]], round_roofs=[10e9, 20e9], peak_flops_per_s=40e9)


def test_bad_sweeps_are_refused():
    from labkit.microbench import MemoryRoof

    with pytest.raises(ValueError, match="rounds must be >= 1"):
        fi.measure("cpu", MemoryRoof(1024), 1e9, rounds=0)
    with pytest.raises(ValueError, match="chain lengths >= 1"):
        fi.measure("cpu", MemoryRoof(1024), 1e9, lengths=(0, 2))
