"""Lab 5's overlap: buckets all-reduced while backward runs leave less of the link on the step."""

import pytest

from labkit import ddp_overlap, ddp_overlap_model as model
from labkit.gradsync_links import LinkMode

MIB = 2**20
LINK = 1e9 / 8  # 1 Gbit/s in bytes per second


def test_one_bucket_waits_for_the_whole_all_reduce():
    # two ranks: the ring sends the whole message once, 8 MiB at 1 Gbit/s
    assert model.modelled_exposed_s([8 * MIB], 0.1, LINK) == pytest.approx(8 * MIB / LINK)


def test_small_buckets_hide_behind_a_backward_longer_than_the_link():
    # each 1 MiB bucket (8.4 ms) is sent before the next is ready (every 12.5 ms): only the last one is exposed
    assert model.modelled_exposed_s([MIB] * 8, 0.1, LINK) == pytest.approx(MIB / LINK)


def test_a_link_slower_than_backward_leaves_its_backlog_exposed():
    # 8 buckets of 8.4 ms against 2.5 ms of backward each: all but 7 x 2.5 ms of the link is exposed
    exposed = model.modelled_exposed_s([MIB] * 8, 0.02, LINK)
    assert exposed == pytest.approx(8 * MIB / LINK - 0.02 * 7 / 8)


def test_bad_buckets_and_times_are_refused():
    with pytest.raises(ValueError, match="bucket_bytes must be one or more sizes > 0"):
        model.modelled_exposed_s([], 0.1, LINK)
    with pytest.raises(ValueError, match="backward_s must be >= 0"):
        model.modelled_exposed_s([MIB], -1, LINK)
    with pytest.raises(ValueError, match="rate_gbit must be > 0"):
        model.OverlapSizes(hidden=8, layers=2, batch=4, timed_steps=1, rounds=1, rate_gbit=0)
    with pytest.raises(ValueError, match="variant must be one of"):
        ddp_overlap.bucket_cap_mb("two buckets")
    with pytest.raises(ValueError, match="world_size must be >= 2"):
        ddp_overlap.run_overlap(world_size=1)


def _result(small_wait_ms: float, small_step_ms: float) -> model.OverlapResult:
    def point(step_ms: float, backward_ms: float, wait_ms: float) -> dict[str, float]:
        return {"step_s": step_ms / 1e3, "backward_s": backward_ms / 1e3, "tail_s": wait_ms / 1e3}

    return model.OverlapResult(
        link_mode=LinkMode("namespaces", "synthetic"), world_size=2, gradient_bytes=8 * MIB,
        sizes=model.OverlapSizes(hidden=512, layers=8, batch=256, timed_steps=1, rounds=1),
        timed={model.NO_COMMUNICATION: point(150, 100, 0.1), "one bucket": point(230, 100, 75),
               "DDP default": point(220, 100, 66), "small buckets": point(small_step_ms, 110, small_wait_ms)},
        bucket_bytes={"one bucket": [8 * MIB], "DDP default": [MIB, 7 * MIB], "small buckets": [MIB] * 8},
        timelines={v: {"backward": [(0.0, 100.0)], "all_reduce": [(100.0, 170.0)]} for v in model.VARIANTS})


def test_what_we_saw_follows_the_values():
    said = " ".join(model.overlap_sentences(_result(small_wait_ms=15, small_step_ms=170)))
    assert "waited 75 ms for it after the last gradient" in said and "waited 15 ms, 20% of the one-bucket wait" in said
    assert "took 110 ms with small buckets against 100 ms with one" in said
    assert "1.35x faster than with one bucket" in said
    assert "1.09x slower than with one bucket" in " ".join(model.overlap_sentences(_result(15, 250)))


def test_the_plot_shows_every_layout(tmp_path):
    fig = model.overlap_plot(_result(15, 170))
    bars, timeline = fig.axes
    assert [t.get_text().split("\n")[0] for t in bars.get_xticklabels()] == list(model.VARIANTS)
    assert "ms" in bars.get_ylabel() and "ms" in timeline.get_xlabel()


def test_hand_buckets_average_gradients_and_launch_in_bucket_order():
    from labkit.launcher import launch
    from tests import rankfns

    backward_order = launch(rankfns.hand_buckets_rank, 2, order="backward", timeout_s=120)[0]
    assert backward_order["max_diff"] < 1e-6
    assert backward_order["launched_while_backward"] == backward_order["buckets"] - 1
    forward_order = launch(rankfns.hand_buckets_rank, 2, order="forward", timeout_s=120)[0]
    assert forward_order["max_diff"] < 1e-6
    assert forward_order["launched_while_backward"] == 0


def test_the_wait_starts_at_the_last_gradient_on_any_rank_so_a_straggler_is_not_communication():
    import torch

    # one step, two ranks: rank 1's backward ends 50 ms after rank 0's; the all-reduce ends 70 ms after that
    marks = torch.tensor([[[0.0, 0.01, 1.00, 1.12, 1.13]], [[0.0, 0.01, 1.05, 1.12, 1.14]]], dtype=torch.float64)
    got = ddp_overlap.fastest_of_steps(marks)
    assert got["tail_s"] == pytest.approx(0.07) and got["step_s"] == pytest.approx(1.14)
    assert got["backward_s"] == pytest.approx(1.04)
    two_steps = torch.cat([marks, marks + torch.tensor([0, 0, 0, -0.05, -0.05], dtype=torch.float64)], dim=1)
    assert ddp_overlap.fastest_of_steps(two_steps)["tail_s"] == pytest.approx(0.02)
    with pytest.raises(ValueError, match="marks must be"):
        ddp_overlap.fastest_of_steps(torch.zeros(2, 0, 5))
