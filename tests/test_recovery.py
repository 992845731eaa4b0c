"""Lab 8: a supervised run survives real faults and ends with the weights it would have had."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from labkit import checkpoint, elastic, heartbeat, interval, processes, recovery_report, savers, stragglers, triage
from labkit import recovery as rc
from labkit import fault_plan, recovery_launch
from labkit import recovery_rank as rr
from labkit.interval import young_daly_interval_s

TINY = {"steps": 12, "checkpoint_every": 4, "features": 32, "hidden": 64, "batch_size": 16}
KILLED_AFTER_A_COMMITTED_CHECKPOINT = {"saver": "sync"}
"""A kill at step 5 restarts from checkpoint 4 only if that save has committed. The async saver's
write can still be in flight two steps later on a loaded box (a run here once resumed from step 0, which is
right: nothing else was committed); the tests that assert step 4 save synchronously."""


def test_fault_plan_naming_a_rank_that_does_not_exist_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"rank must be in \[0, 1\], got 2"):
        rc.supervise(tmp_path / "run", world_size=2, faults=[fault_plan.Fault("kill", 2, 3)], **TINY)
    assert not (tmp_path / "run").exists(), "refused before anything started"


def test_a_backend_other_than_gloo_or_nccl_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(ValueError, match="backend must be 'gloo' .* or 'nccl'"):
        rc.supervise(tmp_path / "run", world_size=2, backend="mpi", **TINY)
    assert not (tmp_path / "run").exists()


def test_fault_plan_naming_a_step_that_does_not_exist_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"step must be in \[0, 11\], got 12"):
        rc.supervise(tmp_path / "run", world_size=2, faults=[fault_plan.Fault("hang", 0, 12)], **TINY)
    with pytest.raises(ValueError, match="fault kind must be one of"):
        fault_plan.validate_faults([fault_plan.Fault("meteor", 0, 1)], world_size=2, steps=10)
    with pytest.raises(ValueError, match="two faults at step 3"):
        fault_plan.validate_faults([fault_plan.Fault("kill", 0, 3), fault_plan.Fault("nan", 1, 3)], world_size=2, steps=10)


def test_random_fault_plan_is_deterministic_and_in_range():
    plan = fault_plan.random_fault_plan(fault_plan.FAULT_KINDS, world_size=2, steps=80, seed=8)
    assert plan == fault_plan.random_fault_plan(fault_plan.FAULT_KINDS, world_size=2, steps=80, seed=8)
    assert sorted(f.kind for f in plan) == sorted(fault_plan.FAULT_KINDS)
    steps = [f.step for f in plan]
    assert all(0 <= f.rank < 2 for f in plan) and steps == sorted(steps)
    assert min(b - a for a, b in zip(steps, steps[1:])) >= 8
    with pytest.raises(ValueError, match="steps must be >= 40"):
        fault_plan.random_fault_plan(fault_plan.FAULT_KINDS, world_size=2, steps=20, seed=0)


def test_restart_count_prefers_torchelastic(monkeypatch):
    monkeypatch.setenv(rr.RESTART_VAR, "2")
    monkeypatch.delenv(rr.TORCHELASTIC_RESTART_VAR, raising=False)
    assert rr.restart_count() == 2
    monkeypatch.setenv(rr.TORCHELASTIC_RESTART_VAR, "5")
    assert rr.restart_count() == 5


def _step(rank: int, step: int, compute_s: float) -> dict:
    return {"event": "step", "t": time.time(), "step": step, "compute_s": compute_s}


def _ranks_ready(watch: heartbeat.HeartbeatWatch, ranks) -> None:
    for rank in ranks:
        watch.feed(rank, {"event": "ready", "t": time.time(), "restored_step": 0})


def test_a_rank_30_percent_slower_is_caught_once_its_whole_window_is_slow():
    watch = heartbeat.HeartbeatWatch(stragglers.StragglerRule(1.15, 7))
    _ranks_ready(watch, [0, 1])
    for step in range(20):
        watch.feed(0, _step(0, step, 0.010))
        watch.feed(1, _step(1, step, 0.010 if step < 10 else 0.013))
        if step == 15:
            assert watch.straggler is None, "its window still holds a step at full speed"
    assert watch.straggler is not None and watch.straggler[0] == 1
    assert "1.30x" in watch.straggler[1] and "steps 10-16" in watch.straggler[1]
    assert watch.straggler[2] == 16, "the verdict names the last step it judged"


def test_the_rules_latency_is_counted_to_its_verdict_and_the_supervisors_to_its_action():
    """A straggler from step 10, judged slow at step 16 of a 7-step window; the supervisor, kept from
    running, acted only once the rank had finished step 20."""
    fault = fault_plan.Fault("straggle", rank=1, step=10)
    det = recovery_report.Detection(0, "straggler", 1, "node1", 20.5, "slow", fault.fault_id, 10.0, step=16)
    records = {0: {1: [{"event": "step", "step": n, "t": float(n)} for n in range(25)]}}
    report = recovery_report.RunReport(Path("/nonexistent"), 2, [fault], [], [det], ["node1"], 0.0, 25.0, records)
    assert report.steps_to_verdict(det) == 7, "the rule needed its window of slow steps"
    assert report.steps_to_detect(det) == 11, "the supervisor acted four steps later"
    assert report.steps_to_verdict(replace(det, step=None)) is None, "no step: not a straggler verdict"


def test_bursts_on_a_healthy_rank_are_noise_not_a_straggler():
    watch = heartbeat.HeartbeatWatch(stragglers.StragglerRule(1.15, 7))
    _ranks_ready(watch, [0, 1])
    for step in range(40):
        watch.feed(0, _step(0, step, 0.010))
        watch.feed(1, _step(1, step, 0.030 if step % 3 else 0.011))
    assert watch.straggler is None, "slow two steps in three, but its fastest step is 1.1x the other's"


def test_a_step_is_judged_once_every_ready_rank_reported_it():
    watch = heartbeat.HeartbeatWatch(stragglers.StragglerRule(1.15, 1, warmup=0))
    _ranks_ready(watch, [0, 1, 2])
    watch.feed(0, _step(0, 0, 0.010))
    watch.feed(1, _step(1, 0, 0.020))
    assert watch.straggler is None, "rank 2 has not reported step 0 yet"
    watch.feed(2, _step(2, 0, 0.010))
    assert watch.straggler is not None and watch.straggler[0] == 1


def test_window_ratios_are_what_the_rule_judges():
    compute = {step: {0: 0.010, 1: 0.010 * (1.3 if step >= 5 else 1.0)} for step in range(10)}
    ratios = stragglers.window_ratios(compute, 5)
    assert ratios[1] == pytest.approx([1.0] * 5 + [1.3])
    assert ratios[0] == pytest.approx([1.0] * 5 + [1 / 1.3])
    rule = stragglers.StragglerRule(1.15, 5)
    assert not rule.is_slow([0.013] * 4, [0.010] * 4), "a window not yet full"
    assert rule.is_slow([0.013, 0.02, 0.013, 0.05, 0.013], [0.010, 0.03, 0.010, 0.010, 0.011])


def test_a_rank_slow_only_in_its_first_steps_is_warming_up_not_straggling():
    for warmup, caught in ((0, True), (10, False)):
        watch = heartbeat.HeartbeatWatch(stragglers.StragglerRule(1.5, 7, warmup))
        _ranks_ready(watch, [0, 1])
        for step in range(30):
            watch.feed(0, _step(0, step, 0.010))
            watch.feed(1, _step(1, step, 0.018 if step < 9 else 0.010))
        assert (watch.straggler is not None) == caught


def _healthy_report(gap: float, steps: int = 60, until: int = 60) -> recovery_report.RunReport:
    """Two ranks over ``steps`` steps; rank 1 runs ``gap`` times rank 0's compute from step 10 to ``until``."""
    records = {0: {rank: [{"event": "step", "step": n, "compute_s": 0.010 * (gap if rank and 10 <= n < until else 1.0)}
                          for n in range(steps)] for rank in (0, 1)}}
    return recovery_report.RunReport(Path("/nonexistent"), 2, [], [], [], [], 0.0, 1.0, records)


def test_a_calibrated_threshold_sits_above_the_widest_healthy_gap_and_never_below_the_floor():
    quiet, busy = stragglers.calibrated(_healthy_report(1.02)), stragglers.calibrated(_healthy_report(1.25))
    assert quiet.factor == stragglers.CALIBRATION_FLOOR, "one quiet run says little about the next"
    assert busy.factor == pytest.approx(1.25 * stragglers.CALIBRATION_HEADROOM)
    assert (busy.window, busy.warmup) == (stragglers.StragglerRule().window, stragglers.StragglerRule().warmup)
    assert stragglers.slowdown_to_show(quiet) == 0.3, "a 30% slower node clears a quiet machine's threshold"
    assert stragglers.slowdown_to_show(busy) == 1.0, "beside a 1.25x drift only a node at half speed is shown"
    with pytest.raises(ValueError, match="no slow node in"):
        stragglers.slowdown_to_show(stragglers.StragglerRule(factor=4.0))


def test_the_widest_gap_before_a_step_counts_only_the_windows_that_end_before_it():
    report = _healthy_report(1.3, until=41)   # only the first judged window, steps 10-40, is all slow
    rule = stragglers.StragglerRule()
    assert stragglers.worst_window_ratio(report, rule) == pytest.approx(1.3)
    assert stragglers.worst_window_ratio(report, rule, before_step=40) == 1.0, "no window ends before step 40"
    assert stragglers.worst_window_ratio(report, rule, before_step=41) == pytest.approx(1.3)


@pytest.mark.parametrize("field, value, says", [("factor", 1.0, "factor must be > 1"),
                                                ("window", 0, "window must be >= 1"),
                                                ("warmup", -1, "warmup must be >= 0")])
def test_a_straggler_rule_that_could_never_or_always_fire_is_refused(field, value, says):
    with pytest.raises(ValueError, match=says):
        stragglers.StragglerRule(**{field: value})


def test_goodput_falls_on_both_sides_of_the_young_daly_interval():
    sweep = interval.interval_sweep(checkpoint_cost_s=2.0, restart_s=30.0, mtbf_s=3 * 3600, work_s=100 * 365 * 86400, seed=1)
    simulated = [row.simulated_goodput for row in sweep]
    best = simulated.index(max(simulated))
    assert sweep[best].factor == 1
    assert simulated[:best + 1] == sorted(simulated[:best + 1])
    assert simulated[best:] == sorted(simulated[best:], reverse=True)
    model = [row.model_goodput for row in sweep]
    assert model.index(max(model)) == best


def test_simulated_goodput_matches_the_first_order_model_near_the_optimum():
    interval_s = young_daly_interval_s(2.0, 3 * 3600)
    row = interval.interval_sweep(checkpoint_cost_s=2.0, restart_s=30.0, mtbf_s=3 * 3600, work_s=100 * 365 * 86400,
                            factors=(1,), seed=2)[0]
    assert row.interval_s == pytest.approx(interval_s)
    assert row.simulated_goodput == pytest.approx(row.model_goodput, abs=0.002)


def test_a_silent_rank_is_never_called_hung_before_the_heartbeat_timeout():
    watch = heartbeat.HeartbeatWatch(stragglers.StragglerRule(1.15, 7))
    now = time.time()
    _ready(watch, [0, 1], now - 20)
    watch.feed(0, {"event": "computed", "t": now - 4.9, "step": 3})
    assert heartbeat.silence_verdict(watch, 2, now, 20.0, 5.0, 60.0) is None
    assert heartbeat.silence_verdict(watch, 2, now + 0.2, 20.2, 5.0, 60.0) is not None


def _report_with_one_failure() -> recovery_report.RunReport:
    """A kill at t=10 s detected at 10.5 s, relaunched at 11, rank 0 ready at 14 (2 s of it reloading), first step
    done at 14.25; rank 0's records say the first attempt reached step 5 and the second redid steps 4-5."""
    det = recovery_report.Detection(0, "exit", 0, "node0", 10.5, "killed", "kill-rank0-step5", 10.0)
    attempts = [recovery_report.Attempt(0, ("node0", "node1"), 0.0, (1, 2), 0, 1.2),
                recovery_report.Attempt(1, ("node2", "node1"), 11.0, (3, 4), 4, 14.25)]

    def step(n, t, checkpoint_s=0.0):
        return {"event": "step", "step": n, "t_start": t, "t_end": t + 0.2, "checkpoint_s": checkpoint_s}

    records = {0: {0: [step(n, 1.0 + 0.2 * n, 0.01 if n == 3 else 0.0) for n in range(6)]},
               1: {0: [{"event": "ready", "t": 14.0, "restored_step": 4, "restore_s": 2.0}, step(4, 14.05), step(5, 14.25)]}}
    return recovery_report.RunReport(Path("/nonexistent"), 2, [], attempts, [det], ["node0"], 0.0, 15.0, records)


def test_recovery_costs_split_a_failure_into_detection_teardown_relaunch_reload_and_first_step():
    report = _report_with_one_failure()
    costs = recovery_report.recovery_costs(report, recovery_report.breakdown(report))
    assert (costs.detect_s, costs.teardown_s, costs.relaunch_s, costs.reload_s) == pytest.approx((0.5, 0.5, 1.0, 2.0))
    assert costs.first_step_s == pytest.approx(0.25)
    assert costs.restart_s == pytest.approx(14.25 - 10.0), "from the fault to the next completed step"
    assert costs.lost_work_s == pytest.approx(0.4) and costs.checkpoint_cost_s == pytest.approx(0.01)


def test_the_same_recovery_costs_give_a_high_goodput_when_failures_are_hours_apart():
    costs = recovery_report.RecoveryCosts(4, 1.0, 0.5, 5.0, 0.5, 0.1, lost_work_s=0.4, checkpoint_cost_s=0.002)
    rare, often = costs.at_mtbf(recovery_report.LLAMA3_MTBF_S), costs.at_mtbf(10.0)
    assert rare.interval_s == pytest.approx(young_daly_interval_s(0.002, recovery_report.LLAMA3_MTBF_S))
    assert rare.goodput > 0.99 > 0.5 > often.goodput
    assert recovery_report.LLAMA3_MTBF_S / 3600 == pytest.approx(3.09, abs=0.01)


def _alive(pids) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory) -> recovery_report.RunReport:
    return rc.supervise(tmp_path_factory.mktemp("lab08") / "clean", world_size=2, spares=0, **TINY)


@pytest.mark.slow
def test_killed_rank_is_replaced_and_the_run_ends_bit_identical(tmp_path, clean_run):
    """Cold start for the reference, warm standby processes for the relaunch: both paths run."""
    clean = clean_run
    faulted = rc.supervise(tmp_path / "faulted", world_size=2, spares=1, faults=[fault_plan.Fault("kill", 1, 5)],
                           warm_standby=True, **TINY, **KILLED_AFTER_A_COMMITTED_CHECKPOINT)
    assert not clean.detections and len(clean.attempts) == 1
    assert faulted.injected == faulted.recovered == ["kill-rank1-step5"]
    detection = faulted.detections[0]
    assert (detection.cause, detection.rank, detection.node) == ("exit", 1, "node1")
    assert faulted.attempts[1].nodes == ("node0", "node2") and faulted.cordoned == ["node1"]
    assert faulted.attempts[1].restored_step == 4
    assert rr.bit_identical(rr.final_weights(clean.run_dir), rr.final_weights(tmp_path / "faulted"))
    breakdown = recovery_report.breakdown(faulted)
    assert breakdown.useful_steps == 12 and breakdown.redone_steps == 1
    assert 0 < breakdown.goodput < 1 and breakdown.restart_s > 0
    (row,) = faulted.detection_table()
    assert (row.node_cordoned, row.replaced_by, row.resumed_from_step) == ("node1", "node2", 4)
    compare = recovery_report.model_beside_measured(faulted, breakdown, TINY["checkpoint_every"])
    assert compare.restart_s == pytest.approx(breakdown.restart_s), "one failure: the whole restart is its cost"
    assert "measured_goodput" in compare.describe()
    every_pid = [pid for report in (clean, faulted) for attempt in report.attempts for pid in attempt.pids]
    assert _alive(every_pid) == [] and faulted.leftover_pids == []


@pytest.mark.slow
def test_hang_without_a_spare_fails_loudly_and_leaves_no_process(tmp_path):
    with pytest.raises(rc.RecoveryError, match="no healthy spare is left") as info:
        rc.supervise(tmp_path / "run", world_size=2, spares=0, faults=[fault_plan.Fault("hang", 0, 6)],
                     heartbeat_timeout_s=2.0, **TINY)
    assert "hang" in str(info.value) and "node0" in str(info.value)
    (detection,) = info.value.report.detections   # what the run measured travels with the error
    assert (detection.cause, detection.fault_id) == ("hang", "hang-rank0-step6") and detection.t_detect > detection.t_fault
    pids = []
    for log in (tmp_path / "run").glob("attempt-*/rank*.jsonl"):
        pids += [json.loads(line)["pid"] for line in log.read_text().splitlines() if '"ready"' in line]
    assert len(pids) == 2 and _alive(pids) == []


def test_supervisor_refuses_to_wipe_a_folder_that_is_not_a_run(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a previous run"):
        rc.supervise(tmp_path, world_size=2, **TINY)
    assert (tmp_path / "precious.txt").exists()


@pytest.mark.slow
def test_same_entry_point_restarts_under_torchrun(tmp_path, clean_run):
    run = elastic.run_torchrun(tmp_path / "run", world_size=2, faults=[fault_plan.Fault("kill", 1, 5)], max_restarts=1,
                               **TINY, **KILLED_AFTER_A_COMMITTED_CHECKPOINT)
    assert run.returncode == 0, run.stderr_tail
    assert run.attempts == 2 and run.restored_step == 4 and run.redone_steps == 1
    assert 0 < run.fault_to_next_step_s < run.wall_s
    assert rr.bit_identical(rr.final_weights(clean_run.run_dir), rr.final_weights(tmp_path / "run"))


@pytest.mark.parametrize("field, value, says", [("max_restarts", -1, "max_restarts must be >= 0"),
                                                ("world_size", 0, "world_size must be >= 1"),
                                                ("timeout_s", 0, "timeout_s must be > 0")])
def test_torchrun_refuses_bad_arguments_by_name(tmp_path, field, value, says):
    arguments = {"world_size": 2, "faults": [], "max_restarts": 1, "timeout_s": 60.0, field: value}
    with pytest.raises(ValueError, match=says):
        elastic.run_torchrun(tmp_path / "run", **arguments, **TINY)


@pytest.mark.slow
def test_torchrun_past_its_timeout_is_killed_with_its_workers(tmp_path):
    with pytest.raises(TimeoutError, match="timeout_s=8"):
        elastic.run_torchrun(tmp_path / "run", world_size=2, faults=[fault_plan.Fault("hang", 0, 2)], max_restarts=0,
                             timeout_s=8, **TINY)
    pids = [json.loads(line)["pid"] for path in (tmp_path / "run").glob("attempt-*/rank*.jsonl")
            for line in path.read_text().splitlines() if '"ready"' in line]
    assert pids and not any(processes.running(pid) for pid in pids), "no rank outlives torchrun"


@pytest.mark.slow
def test_ranks_exit_when_their_supervisor_is_killed(tmp_path):
    run = tmp_path / "run"
    script = (
        "from labkit import fault_plan\nfrom labkit import recovery as rc\n"
        f"rc.supervise({str(run)!r}, world_size=2, spares=1, faults=[fault_plan.Fault('hang', 0, 6)], "
        f"heartbeat_timeout_s=600, **{TINY!r})\n"
    )
    supervisor_log = tmp_path / "supervisor.log"
    with open(supervisor_log, "w") as out:
        supervisor = subprocess.Popen([sys.executable, "-c", script], stdout=out, stderr=subprocess.STDOUT)
    try:
        pids: list[int] = []
        deadline = time.time() + 240
        while len(pids) < 2 and time.time() < deadline and supervisor.poll() is None:
            time.sleep(0.5)
            pids = [json.loads(line)["pid"] for log in run.glob("attempt-000/rank*.jsonl")
                    for line in log.read_text().splitlines() if '"ready"' in line]
        assert supervisor.poll() is None, f"the supervisor ended early:\n{supervisor_log.read_text()[-3000:]}"
        assert len(_alive(pids)) == 2, "both ranks started"
    finally:
        supervisor.kill()
        supervisor.wait()
    deadline = time.time() + 10
    while _alive(pids) and time.time() < deadline:
        time.sleep(0.2)
    assert _alive(pids) == [], "ranks notice their supervisor is gone and exit"


@pytest.fixture()
def one_rank_group(tmp_path, monkeypatch):
    """train_rank in this process, as a world of one gloo rank."""
    import torch.distributed as dist

    monkeypatch.delenv(rr.RESTART_VAR, raising=False)
    monkeypatch.delenv(rr.TORCHELASTIC_RESTART_VAR, raising=False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_rank_whose_checkpoint_does_not_load_fails_loudly_instead_of_starting_over(tmp_path, one_rank_group,
                                                                                    monkeypatch):
    """A numpy scalar once made Lab 8's checkpoints unloadable and its rank quietly restarted from step 0."""
    model = rr.make_model(TINY["features"], TINY["hidden"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = checkpoint.capture_training_state(model, optimizer, loader_position=4)
    state["extra"] = {"epoch": np.int64(1)}
    monkeypatch.setattr(checkpoint, "check_loadable", lambda *args, **kwargs: None, raising=False)
    with savers.SyncSaver(tmp_path / "run" / "checkpoints") as saver:
        saver.save(4, state)
    monkeypatch.undo()
    with pytest.raises(checkpoint.CheckpointError, match="step-000000004: state.pt does not load"):
        rr.train_rank(str(tmp_path / "run"), **TINY)


def _raise_inside_torch_distributed(exc: BaseException) -> BaseException:
    """An exception whose innermost frame is in torch.distributed, as gloo's peer-lost error is."""
    import torch.distributed.distributed_c10d as c10d

    code = compile("raise exc", c10d.__file__, "exec")
    try:
        exec(code, {"exc": exc})
    except BaseException as raised:  # noqa: BLE001
        return raised
    raise AssertionError("unreachable")


def test_a_peer_lost_in_a_collective_is_the_network_and_a_typo_is_the_program():
    lost_peer = _raise_inside_torch_distributed(RuntimeError("Connection closed by peer [127.0.0.1]:51860"))
    assert triage.classify_exception(lost_peer) == triage.COMMUNICATION
    assert triage.classify_exception(torch.distributed.DistNetworkError("store timed out")) == triage.COMMUNICATION
    assert triage.classify_exception(TypeError("train_rank() got an unexpected keyword argument")) == triage.PROGRAM
    try:
        torch.nn.functional.linear(torch.ones(2, 3), torch.ones(4, 5))
    except RuntimeError as shape_bug:
        assert triage.classify_exception(shape_bug) == triage.PROGRAM
    assert triage.classify_exception(torch.AcceleratorError("CUDA error: uncorrectable ECC error")) == triage.DEVICE
    record = triage.error_record(lost_peer)
    assert record["error_type"] == "RuntimeError" and "Traceback" in record["traceback"]


def test_the_rank_that_raised_is_blamed_not_the_peer_that_lost_it():
    errors = {0: {"origin": triage.COMMUNICATION}, 1: {"origin": triage.PROGRAM}}
    assert triage.blame([(0, 1), (1, 1)], errors) == (1, 1)
    assert triage.blame([(0, 1), (1, -9)], {0: {"origin": triage.COMMUNICATION}}) == (1, -9)


def test_a_failure_repeated_before_a_first_step_on_a_fresh_node_stops_the_run():
    judge = triage.RetryJudge()
    assert judge.why_stop("hang", 0, None, completed_a_step=False) is None, "the first time, retry on a spare"
    assert "two nodes in a row" in judge.why_stop("hang", 0, None, completed_a_step=False)
    judge = triage.RetryJudge()
    assert judge.why_stop("hang", 0, None, completed_a_step=False) is None
    assert judge.why_stop("exit", 1, None, completed_a_step=False) is None, "a different failure: retry"
    assert judge.why_stop("exit", 1, None, completed_a_step=True) is None, "progress was made: retry"
    assert judge.why_stop("exit", 1, None, completed_a_step=False) is None
    assert "program" in triage.RetryJudge().why_stop(
        "exit", 0, {"origin": triage.PROGRAM, "error_type": "TypeError", "message": "typo"}, completed_a_step=True)


def test_a_nan_is_the_programs_and_cordons_no_node_while_a_death_hang_or_straggler_may_be_the_nodes():
    assert not triage.node_at_fault("nonfinite")
    assert all(triage.node_at_fault(cause) for cause in ("exit", "hang", "straggler"))
    with pytest.raises(ValueError, match="cause must be one of"):
        triage.node_at_fault("cosmic ray")


def _ready(watch: heartbeat.HeartbeatWatch, ranks, t: float) -> None:
    for rank in ranks:
        watch.feed(rank, {"event": "ready", "t": t, "restored_step": 0})


def test_silence_before_the_first_step_is_a_hang_once_every_rank_is_ready():
    watch = heartbeat.HeartbeatWatch(stragglers.StragglerRule(1.15, 7))
    now = time.time()
    _ready(watch, [0], now - 10)
    assert heartbeat.silence_verdict(watch, 2, now, 10.0, 2.0, 60.0) is None, "rank 1 is still starting up"
    _ready(watch, [1], now - 9)
    watch.feed(1, {"event": "computed", "t": now - 8, "step": 0})
    rank, detail = heartbeat.silence_verdict(watch, 2, now, 10.0, 2.0, 60.0)
    assert rank == 0 and "before its first step" in detail
    late = heartbeat.HeartbeatWatch(stragglers.StragglerRule(1.15, 7))
    _ready(late, [1], now)
    assert heartbeat.silence_verdict(late, 2, now, 61.0, 2.0, 60.0) == (
        0, "rank 0 was not ready within startup_timeout_s=60s")


@pytest.mark.slow
def test_a_typo_in_train_kwargs_stops_at_once_with_the_traceback_and_burns_no_spare(tmp_path):
    with pytest.raises(rc.RecoveryError, match="TypeError") as info:
        rc.supervise(tmp_path / "run", world_size=2, spares=2, hiden=64, **TINY)
    assert "unexpected keyword argument 'hiden'" in str(info.value)
    assert "Traceback" in info.value.rank_traceback and "not a node failure" in str(info.value)
    assert sorted(p.name for p in (tmp_path / "run").glob("attempt-*")) == ["attempt-000"]


@pytest.mark.slow
def test_a_hang_at_the_first_step_is_recovered_like_any_other_hang(tmp_path, clean_run):
    report = rc.supervise(tmp_path / "run", world_size=2, spares=1, faults=[fault_plan.Fault("hang", 0, 0)],
                          heartbeat_timeout_s=2.0, startup_timeout_s=40.0, **TINY)
    assert report.injected == report.recovered == ["hang-rank0-step0"]
    assert report.detections[0].cause == "hang" and report.attempts[1].restored_step == 0
    assert rr.bit_identical(rr.final_weights(clean_run.run_dir), rr.final_weights(tmp_path / "run"))
    assert report.leftover_pids == []


def test_a_spare_gets_the_gpu_of_the_slot_it_takes_not_the_failed_ranks(monkeypatch, tmp_path):
    started = []

    class FakePopen:
        def __init__(self, args, *, env, **kwargs):
            started.append(env)

    monkeypatch.setattr(rc.subprocess, "Popen", FakePopen)
    nodes = [f"node{i}" for i in range(4)]
    assignment = [0, 2]      # rank 1's node1 was cordoned; the spare node2 took its place
    recovery_launch.launch_attempt(tmp_path, "run-id", 1, assignment, nodes, [], {}, None, "nccl", 29500)
    assert [(env["RANK"], env["LABKIT_NODE"], env["LOCAL_RANK"]) for env in started] == [
        ("0", "node0", "0"), ("1", "node2", "2")]


def test_nccl_recovery_with_fewer_gpus_than_node_slots_is_refused_before_anything_starts(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="world_size \\+ spares = 4 node slots .* this machine has 2"):
        rc.supervise(tmp_path / "run", world_size=2, spares=2, backend="nccl", **TINY)
    assert not (tmp_path / "run").exists()
