"""Delayed gradient sync: fewer all-reduces, same bytes per sync, faster on a slow link."""

import pytest

from labkit import gradsync as g
from labkit.collectives import ring_bytes_per_rank

SMALL = {"hidden": 512, "layers": 4, "micro_batch": 4, "accumulation": 4, "optimizer_steps": 3, "warmup_steps": 1}


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_accumulation_below_one_is_refused(bad):
    with pytest.raises(ValueError, match="accumulation must be an integer >= 1"):
        g.check_accumulation(bad)


def test_bad_arguments_fail_before_any_rank_starts():
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        g.run_experiment(world_size=0)
    with pytest.raises(ValueError, match="link must be one of"):
        g.run_experiment(links=("10 Gbps",))
    with pytest.raises(ValueError, match="accumulation must be"):
        g.run_experiment(sizes={**SMALL, "accumulation": 0})
    with pytest.raises(ValueError, match="stage must be"):
        g.run_experiment(deepspeed_stages=(4,))


def test_experiment_pairs_the_baseline_with_the_fix_for_every_link():
    configs = g.experiment_configs(["1 Gbps", None], 8)
    assert len(configs) == 6
    assert {c["mode"] for c in configs} == set(g.MODES)


def test_ring_model_predicts_one_all_reduce_of_the_gradients_per_sync():
    assert g.predicted_ring_bytes_per_step(4000, 2, 3) == 3 * ring_bytes_per_rank("all_reduce", 4000, 2)


@pytest.fixture(scope="module")
def measured():
    return g.run_experiment(
        world_size=2, links=("1 Gbps",), deepspeed_stages=(1, 2), deepspeed_accumulation=4, sizes=SMALL
    )


@pytest.mark.slow
def test_delayed_sync_cuts_all_reduce_calls_by_exactly_the_accumulation_factor(measured):
    acc = SMALL["accumulation"]
    every = g.find_row(measured["ddp"], mode="sync_every_micro_step", accumulation=acc)
    delayed = g.find_row(measured["ddp"], mode="delayed_sync", accumulation=acc)
    assert delayed["all_reduce_calls_per_step"] >= 1
    assert every["all_reduce_calls_per_step"] == acc * delayed["all_reduce_calls_per_step"]


@pytest.mark.slow
def test_delayed_sync_makes_the_same_update(measured):
    assert measured["same_update_max_diff"] < 1e-6


@pytest.mark.slow
def test_counted_gradient_bytes_match_the_ring_model(measured):
    acc, n, grad_bytes = SMALL["accumulation"], measured["world_size"], measured["gradient_bytes"]
    for mode, syncs in (("sync_every_micro_step", acc), ("delayed_sync", 1)):
        row = g.find_row(measured["ddp"], mode=mode, accumulation=acc)
        assert row["all_reduce_bytes_per_step"] == syncs * grad_bytes
        assert row["ring_bytes_per_step"] == g.predicted_ring_bytes_per_step(grad_bytes, n, syncs)


@pytest.mark.slow
def test_on_a_slow_link_no_accumulation_is_slower_per_sample_than_delayed_sync(measured):
    no_acc = g.find_row(measured["ddp"], accumulation=1)
    delayed = g.find_row(measured["ddp"], mode="delayed_sync")
    assert no_acc["ms_per_sample"] > delayed["ms_per_sample"], (no_acc, delayed)


@pytest.mark.slow
def test_deepspeed_stage1_reduces_once_per_window_and_stage2_every_micro_step(measured):
    by_stage = {d["stage"]: d for d in measured["deepspeed"]}
    stage1, stage2 = by_stage[1]["calls_per_micro_step"], by_stage[2]["calls_per_micro_step"]
    assert all(not calls for calls in stage1[:-1]) and stage1[-1]
    assert all(calls for calls in stage2)
