"""Goodput measured at checkpoint intervals: the loops' bookkeeping, and bad sizes named."""

from pathlib import Path

import pytest
import torch

from labkit import interval_runs as ir

TINY = ir.IntervalSizes(width=16, batch=4, failures=2)


@pytest.mark.parametrize("field, value, says", [
    ("width", 0, "width must be >= 1"),
    ("failures", 0, "failures must be >= 1"),
    ("factors", (), "factors must all be > 0"),
    ("factors", (1.0, -1.0), "factors must all be > 0"),
    ("mtbf_over_optimum", 4.0, "mtbf_over_optimum must be at least twice the largest factor"),
    ("shorter_share", 0.0, r"shorter_share must be in \(0, 1\]"),
    ("shorter_share", 1.5, r"shorter_share must be in \(0, 1\]"),
])
def test_bad_sizes_name_the_field(field, value, says):
    kwargs = {"width": 8, "batch": 2, "failures": 1, field: value}
    with pytest.raises(ValueError, match=says):
        ir.IntervalSizes(**kwargs)


def test_arrivals_fall_one_in_each_window_and_repeat_with_the_seed():
    arrivals, again = ir.Arrivals(2.0, seed=3), ir.Arrivals(2.0, seed=3)
    points = [arrivals[i] for i in range(50)]
    assert all(2.0 * i <= p < 2.0 * (i + 1) for i, p in enumerate(points))
    assert points == [again[i] for i in range(50)]
    with pytest.raises(ValueError, match="mtbf_s must be > 0"):
        ir.Arrivals(0.0, seed=0)


def test_a_loop_saves_once_its_steps_have_taken_the_interval_and_at_the_end(tmp_path: Path):
    every_step = ir._Loop(TINY, interval_s=1e-9, useful_steps=10, arrivals=None, path=tmp_path / "c.pt")
    at_the_end = ir._Loop(TINY, interval_s=1e9, useful_steps=10, arrivals=None, path=tmp_path / "d.pt")
    for loop in (every_step, at_the_end):
        while not loop.done:
            loop.advance()
        assert loop.failures == 0 and loop.redone_steps == 0
    assert every_step.saves == 10 and every_step.full_stretches == 10 and every_step.measured_interval_s > 0
    assert at_the_end.saves == 1 and at_the_end.full_stretches == 0 and at_the_end.measured_interval_s == 1e9
    assert torch.load(tmp_path / "d.pt")["position"] == 10


def test_a_failure_reloads_the_last_checkpoint_and_redoes_the_steps_since(tmp_path: Path):
    class AtOnce:   # the first failure after the loop's first step; no more
        def __getitem__(self, index):
            return 0.0 if index == 0 else float("inf")

    loop = ir._Loop(TINY, interval_s=1e9, useful_steps=10, arrivals=AtOnce(), path=tmp_path / "c.pt")
    loop.advance()
    assert loop.failures == 1 and loop.redone_steps == 1 and loop.position == 0
    while not loop.done:
        loop.advance()
    plain = ir._Loop(TINY, interval_s=0.0, useful_steps=10, arrivals=None, path=tmp_path / "p.pt")
    while not plain.done:
        plain.advance()
    assert loop.trainer.weights_sha256() == plain.trainer.weights_sha256()


def test_the_experiment_measures_every_interval_against_the_same_baseline():
    experiment = ir.measure(TINY)
    assert [run.factor for run in experiment.runs] == list(TINY.factors)
    *shorter, longest = experiment.runs   # the shorter intervals run a share of the longest's steps
    assert all(run.useful_steps == round(longest.useful_steps * TINY.shorter_share) for run in shorter)
    assert all(run.baseline_s < longest.baseline_s for run in shorter), "the baseline's time for fewer steps"
    assert all(0 < run.goodput <= 1.5 and run.failures >= 1 for run in experiment.runs)
    assert all(run.interval_s >= run.factor * experiment.calibration.optimum_s for run in experiment.runs)
    assert experiment.same_weights()
    assert experiment.costs.mtbf_s == experiment.calibration.mtbf_s
    assert min(experiment.costs.step_s, experiment.costs.save_s, experiment.costs.reload_s) > 0
    assert "goodput measured" in experiment.describe()
