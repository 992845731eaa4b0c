"""Delayed gradient sync: fewer all-reduces, same bytes per sync, faster on a slow link."""

import dataclasses

import pytest

from labkit import gradsync as g
from labkit import gradsync_links, gradsync_model
from labkit.collectives import ring_bytes_per_rank
from labkit.topology import GBIT

SMALL = g.GradSyncSizes(hidden=512, layers=4, micro_batch=4, accumulation=4, optimizer_steps=3, warmup_steps=1)
GRADIENT_BYTES = 4_202_496


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_accumulation_below_one_is_refused(bad):
    with pytest.raises(ValueError, match="accumulation must be an integer >= 1"):
        gradsync_model.check_accumulation(bad)


def test_bad_arguments_fail_before_any_rank_starts():
    with pytest.raises(ValueError, match="world_size must be >= 2"):
        g.run_experiment(world_size=1)
    with pytest.raises(ValueError, match="rates_gbit must be one or more rates > 0"):
        g.run_experiment(rates_gbit=(0.0,))
    with pytest.raises(ValueError, match="accumulation must be"):
        g.run_experiment(sizes=dataclasses.replace(SMALL, accumulation=0))
    with pytest.raises(ValueError, match="stage must be"):
        g.run_experiment(deepspeed_stages=(4,))


def test_delayed_sync_predicts_one_sync_per_window_and_the_baseline_one_per_micro_batch():
    assert gradsync_model.syncs_per_step("sync_every_micro_step", 8) == 8
    assert gradsync_model.syncs_per_step("delayed_sync", 8) == 1
    with pytest.raises(ValueError, match="mode must be one of"):
        gradsync_model.syncs_per_step("sometimes", 8)


def test_ring_model_predicts_one_all_reduce_of_the_gradients_per_sync():
    assert gradsync_model.predicted_ring_bytes_per_step(4000, 2, 3) == 3 * ring_bytes_per_rank("all_reduce", 4000, 2)


def test_predicted_step_is_compute_plus_each_sync_at_the_link_rate_with_framing():
    two_nodes = gradsync_links.two_node_topology(2, 0.1)
    assert two_nodes.inter_node_bytes_per_s == pytest.approx(0.1 * GBIT)
    # 2 ranks: the ring sends the whole gradient each way once per all-reduce
    one_sync_s = GRADIENT_BYTES / (0.1 * GBIT)
    assert gradsync_model.predicted_step_s(0.03, 8, GRADIENT_BYTES, two_nodes) == pytest.approx(0.03 + 8 * one_sync_s)
    assert gradsync_model.predicted_step_s(0.03, 1, GRADIENT_BYTES, two_nodes, 1.05) == pytest.approx(0.03 + 1.05 * one_sync_s)
    with pytest.raises(ValueError, match="must be >= 0"):
        gradsync_model.predicted_step_s(-1.0, 1, GRADIENT_BYTES, two_nodes)


def test_ms_per_sample_divides_by_every_sample_of_the_step():
    assert gradsync_model.ms_per_sample(0.064, 2, 8, 4) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="world_size and micro_batch must be >= 1"):
        gradsync_model.ms_per_sample(1.0, 0, 8, 4)


def test_framing_is_none_when_no_shaper_counted_the_bytes():
    assert gradsync_model.framing(1047, 1000) == pytest.approx(1.047)
    assert gradsync_model.framing(0, 1000) is None
    with pytest.raises(ValueError, match="payload_bytes must be > 0"):
        gradsync_model.framing(10, 0)


def _synthetic_result(wire_per_payload: float, tx_per_model: float = 0.0) -> gradsync_model.GradSyncResult:
    """Two ranks' measurements at 0.1 Gbit/s as train_rank returns them, turned into a result with the model."""
    ring = GRADIENT_BYTES
    ranks = [{
        "rows": [
            {"rate_gbit": 0.1, "mode": mode, "accumulation": 8, "step_s": 2.56, "ms_per_sample": 40.0,
             "all_reduce_calls_per_step": syncs, "all_reduce_bytes_per_step": syncs * ring,
             "ring_bytes_per_step": syncs * ring, "tx_bytes_per_step": tx_per_model * syncs * ring,
             "wire_bytes_per_step": wire_per_payload * syncs * ring, "emulated_s_per_step": 0.0, "final_loss": 1.0}
            for mode, syncs in (("sync_every_micro_step", 8), ("delayed_sync", 1))
        ],
        "single_device": {"step_s": 0.032, "ms_per_sample": 1.0}, "gradient_bytes": GRADIENT_BYTES,
        "same_update_max_diff": 0.0,
    } for _ in range(2)]
    return gradsync_model.gradsync_result(ranks, dataclasses.replace(SMALL, micro_batch=4),
                                          gradsync_links.LinkMode("namespaces", "synthetic"))


def test_predictions_use_the_measured_framing_and_say_how_far_the_measurement_is():
    result = _synthetic_result(1.05)
    assert result.wire_bytes_per_payload_byte == pytest.approx(1.05)
    every = result.row(0.1, "sync_every_micro_step")
    model_s = 0.032 + 8 * 1.05 * GRADIENT_BYTES / (0.1 * GBIT)
    assert every.model_ms_per_sample == pytest.approx(1e3 * model_s / 64)
    assert every.measured_over_model == pytest.approx(40.0 / every.model_ms_per_sample)
    assert every.model_link_share == pytest.approx(1 - 0.032 / model_s)
    assert every.model_ring_bytes_per_step == 8 * GRADIENT_BYTES


def test_without_shapers_the_model_assumes_no_framing():
    result = _synthetic_result(0.0)
    assert result.wire_bytes_per_payload_byte is None
    delayed = result.row(0.1, "delayed_sync")
    assert delayed.model_ms_per_sample == pytest.approx(1e3 * (0.032 + GRADIENT_BYTES / (0.1 * GBIT)) / 64)


def test_the_diagnosis_of_each_mode_is_averaged_over_ranks_and_set_beside_the_ring_model():
    from labkit import gradsync_diagnosis

    def diagnosed(comm: float, step_ms: float) -> dict:
        shares = {"data": 0.0, "host_to_device": 0.0, "compute": 0.95 - comm, "communication": comm,
                  "checkpoint": 0.0, "other": 0.05}
        return {"shares": shares, "step_ms": step_ms, "unprofiled_step_ms": step_ms / 1.1}

    result = dataclasses.replace(_synthetic_result(1.05), diagnose_rate_gbit=0.1, diagnoses=(
        {"sync_every_micro_step": diagnosed(0.90, 1000.0), "delayed_sync": diagnosed(0.70, 200.0)},
        {"sync_every_micro_step": diagnosed(0.80, 1000.0), "delayed_sync": diagnosed(0.60, 200.0)}))
    every, delayed = gradsync_diagnosis.diagnosed_modes(result)
    assert (every.mode, delayed.mode) == ("sync_every_micro_step", "delayed_sync")
    assert every.shares["communication"] == pytest.approx(0.85) and every.verdict.bottleneck == "communication"
    assert every.link_ms == pytest.approx(850.0) and every.overhead == pytest.approx(1.1)
    syncs = SMALL.accumulation   # the sizes' window sets the syncs a step of each mode pays
    assert every.model_link_ms == pytest.approx(1e3 * syncs * 1.05 * GRADIENT_BYTES / (0.1 * GBIT))
    assert delayed.model_link_ms == pytest.approx(every.model_link_ms / syncs)
    assert delayed.link_over_model == pytest.approx(0.65 * 200.0 / delayed.model_link_ms)
    assert gradsync_diagnosis.diagnosed_modes(_synthetic_result(1.05)) == (), "nothing diagnosed, nothing to show"


def test_a_row_is_found_by_rate_and_mode_and_a_missing_one_names_the_rates_measured():
    result = _synthetic_result(1.05)
    assert result.row(0.1, "delayed_sync").all_reduce_calls_per_step == 1
    with pytest.raises(KeyError, match=r"rates measured: \[0.1\]"):
        result.row(4.0, "delayed_sync")


def test_links_fall_back_to_the_sleep_emulation_and_say_why(monkeypatch):
    from labkit import fabric

    monkeypatch.setenv(gradsync_links.EMULATED_ENV, "emulated")
    assert gradsync_links.link_mode().label == f"emulated (sleep): {gradsync_links.EMULATED_ENV}=emulated is set"
    monkeypatch.delenv(gradsync_links.EMULATED_ENV)
    monkeypatch.setattr(fabric, "probe", lambda: fabric.Capability("emulated", "network namespaces need root"))
    assert gradsync_links.link_mode().label == "emulated (sleep): network namespaces need root"
    monkeypatch.setattr(fabric, "probe", lambda: fabric.Capability("namespaces", "tbf works"))
    assert gradsync_links.link_mode().label == "real shaped links (namespaces)"


@pytest.fixture(scope="module")
def emulated():
    """The sleep-emulation path (where no fabric can be built), forced so it runs on every machine."""
    return g.run_experiment(
        world_size=2, rates_gbit=(0.5,), deepspeed_stages=(1, 2), deepspeed_accumulation=4, sizes=SMALL,
        mode=gradsync_links.LinkMode("emulated", "forced by the test"),
    )


@pytest.mark.slow
def test_the_emulated_run_says_so_and_its_links_only_sleep(emulated):
    assert emulated.mode_label == "emulated (sleep): forced by the test" and not emulated.real_links
    assert emulated.wire_bytes_per_payload_byte is None
    every = emulated.row(0.5, "sync_every_micro_step")
    assert every.emulated_s_per_step > 0 and every.tx_bytes_per_step == 0


@pytest.mark.slow
def test_delayed_sync_cuts_all_reduce_calls_by_exactly_the_accumulation_factor(emulated):
    acc = SMALL.accumulation
    every = emulated.row(0.5, "sync_every_micro_step")
    delayed = emulated.row(0.5, "delayed_sync")
    assert delayed.all_reduce_calls_per_step >= 1
    assert every.all_reduce_calls_per_step == acc * delayed.all_reduce_calls_per_step


@pytest.mark.slow
def test_delayed_sync_makes_the_same_update(emulated):
    assert emulated.same_update_max_diff < 1e-6


@pytest.mark.slow
def test_counted_gradient_bytes_match_the_ring_model(emulated):
    acc, grad_bytes = SMALL.accumulation, emulated.gradient_bytes
    for mode, syncs in (("sync_every_micro_step", acc), ("delayed_sync", 1)):
        row = emulated.row(0.5, mode)
        assert row.all_reduce_bytes_per_step == syncs * grad_bytes
        assert row.ring_bytes_per_step == row.model_ring_bytes_per_step


@pytest.mark.slow
def test_deepspeed_stage1_reduces_once_per_window_and_stage2_every_micro_step(emulated):
    by_stage = {d.stage: d for d in emulated.deepspeed}
    stage1, stage2 = by_stage[1].calls_per_micro_step, by_stage[2].calls_per_micro_step
    assert all(not calls for calls in stage1[:-1]) and stage1[-1]["all_reduce"]
    assert all(calls.get("all_reduce") for calls in stage2)


@pytest.mark.slow
def test_deepspeed_stages_1_and_2_all_gather_the_updated_parameters_once_per_step(emulated):
    """Seen only because the counter is active before deepspeed.init_distributed binds its functions."""
    for ds in emulated.deepspeed:
        assert ds.calls_per_optimizer_step["all_gather"] == 1
        assert ds.message_bytes_per_optimizer_step["all_gather"] == ds.parameter_bytes
        assert all("all_gather" not in calls for calls in ds.calls_per_micro_step[:-1])


def test_bytes_sent_are_compared_with_the_ring_model_over_the_whole_run():
    result = _synthetic_result(1.05, tx_per_model=1.01)
    assert result.row(0.1, "delayed_sync").tx_bytes_per_step_by_rank == pytest.approx((1.01 * GRADIENT_BYTES,) * 2)
    assert result.sent_over_model() == pytest.approx(1.01)


def test_each_sync_beyond_compute_counts_syncs_not_ddps_bucket_all_reduces():
    result = _synthetic_result(1.05)
    every = dataclasses.replace(result.row(0.1, "sync_every_micro_step"), all_reduce_calls_per_step=16)
    assert gradsync_model.sync_beyond_compute_ms(result, every) == pytest.approx(1e3 * (2.56 - 0.032) / 8)


def test_the_models_time_for_one_sync_is_the_gradients_ring_all_reduce_on_the_link_with_framing():
    """With two ranks a ring all-reduce sends 2 x (2-1)/2 = 1 gradient per rank; framing adds 5% on the wire."""
    result = _synthetic_result(1.05)
    for mode in ("sync_every_micro_step", "delayed_sync"):
        assert gradsync_model.model_sync_ms(result, result.row(0.1, mode)) == pytest.approx(
            1e3 * 1.05 * GRADIENT_BYTES / (0.1 * GBIT))


def test_what_we_saw_takes_its_comparison_words_from_the_values():
    result = _synthetic_result(1.05)
    every = result.row(0.1, "sync_every_micro_step")
    faster = dataclasses.replace(result.row(0.1, "delayed_sync"), ms_per_sample=10.0)
    result = dataclasses.replace(result, rows=(every, faster))
    said = " ".join(gradsync_model.ordering_sentences(result, (0.1,)))
    assert "delayed sync was 4.00x faster than syncing every micro-batch" in said
    assert "were 40.0x slower than one rank alone" in said
    slower = dataclasses.replace(faster, ms_per_sample=80.0)
    said = " ".join(gradsync_model.ordering_sentences(dataclasses.replace(result, rows=(every, slower)), (0.1,)))
    assert "delayed sync was 2.00x slower than syncing every micro-batch" in said
    model = " ".join(gradsync_model.model_sentences(result))
    assert f"{every.ms_per_sample:.1f} ms per sample against the model's {every.model_ms_per_sample:.1f}" in model
