"""Lab 7: how often to checkpoint (Young/Daly), as pure arithmetic."""

import math

import pytest

from labkit.interval import (
    expected_lost_work_s,
    goodput_fraction,
    plan_interval,
    restore_time_s,
    young_daly_interval_s,
)


def test_young_daly_interval_is_sqrt_of_two_cost_times_mtbf():
    assert young_daly_interval_s(60.0, 3 * 3600.0) == pytest.approx(math.sqrt(2 * 60 * 3 * 3600))
    assert young_daly_interval_s(4 * 10.0, 3600.0) == pytest.approx(2 * young_daly_interval_s(10.0, 3600.0))


def test_young_daly_interval_maximises_goodput():
    cost_s, mtbf_s = 30.0, 3 * 3600.0
    best_s = young_daly_interval_s(cost_s, mtbf_s)
    best = goodput_fraction(best_s, cost_s, mtbf_s)
    for factor in (0.25, 0.5, 2.0, 4.0):
        assert goodput_fraction(best_s * factor, cost_s, mtbf_s) < best


def test_lost_work_is_half_a_period_per_failure():
    assert expected_lost_work_s(600.0, 20.0) == pytest.approx(310.0)


def test_cheaper_blocking_saves_raise_goodput_and_shorten_the_interval():
    mtbf_s = 3 * 3600.0
    sync, async_ = plan_interval(40.0, mtbf_s), plan_interval(2.0, mtbf_s)
    assert async_.interval_s < sync.interval_s
    assert async_.lost_work_per_failure_s < sync.lost_work_per_failure_s
    assert async_.goodput > sync.goodput


def test_goodput_counts_restarts_and_never_goes_negative():
    assert goodput_fraction(600.0, 10.0, 3600.0, restart_s=300.0) < goodput_fraction(600.0, 10.0, 3600.0)
    assert goodput_fraction(600.0, 10.0, 100.0, restart_s=300.0) == 0.0


def test_restore_model_is_startup_plus_bytes_over_bandwidth():
    assert restore_time_s(10e9, 1e9, startup_s=5.0) == pytest.approx(15.0)
    assert restore_time_s(10e9, 25e9) < restore_time_s(10e9, 1e9)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: young_daly_interval_s(0.0, 10.0), "checkpoint_cost_s must be"),
        (lambda: young_daly_interval_s(1.0, -5.0), "mtbf_s must be"),
        (lambda: goodput_fraction(10.0, 1.0, 100.0, restart_s=-1.0), "restart_s must be"),
        (lambda: expected_lost_work_s(float("nan"), 1.0), "interval_s must be"),
        (lambda: restore_time_s(1.0, 0.0), "read_bytes_per_s must be"),
    ],
)
def test_bad_inputs_name_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_one_scenario_gives_a_saver_one_goodput_in_the_widget_the_figure_and_the_restore_model():
    """Lab 7 shows the same async saver in a widget, a figure and the restore-cache model: one number."""
    from labkit.interval import STARTUP_S, STORE_READ_BYTES_PER_S, Scenario, plan_text, plot_saver_plans

    scenario = Scenario()
    assert scenario.restart_s == pytest.approx(restore_time_s(scenario.state_gb * 1e9, STORE_READ_BYTES_PER_S,
                                                              STARTUP_S))
    per_gb = {"sync": 4.0, "async": 0.3}
    plans = scenario.plans(per_gb)
    text = plan_text(per_gb, state_gb=scenario.state_gb, mtbf_h=scenario.mtbf_s / 3600, restart_s=scenario.restart_s)
    assert f"goodput {plans['async'].goodput:.4f}" in text.splitlines()[1]
    fig = plot_saver_plans(per_gb, {"sync": "red", "async": "blue"}, scenario)
    dots = [line for line in fig.axes[0].lines if len(line.get_xdata()) == 1]
    assert [line.get_ydata()[0] for line in dots] == [plans["sync"].goodput, plans["async"].goodput]
    assert plans["async"].goodput == plan_interval(0.3 * scenario.state_gb, scenario.mtbf_s, scenario.restart_s).goodput
