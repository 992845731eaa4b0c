"""Lab 8 targets: recovery from a killed rank, the placement simulator's speed, the torchrun path,
and the placement measured on real links (the bands of labkit.placement_probe).

    python benchmarks/lab08_recovery_and_placement.py            # all four
    python benchmarks/lab08_recovery_and_placement.py --skip-torchrun
    python benchmarks/lab08_recovery_and_placement.py --only-fabric --fabric-repeats 8
    python benchmarks/lab08_recovery_and_placement.py --only-straggler --straggler-runs 10 --elastic-pairs 5
    python benchmarks/lab08_recovery_and_placement.py --only-intervals 10

Targets (issue 9, CI profile): a killed rank back to the next training step in <= 15 s;
10,000 GPUs and 1,000 jobs simulated in <= 5 s. On the fabric (issue 16; needs root, else it says
so and skips): per repeat and placement, measured step over the simulator's step from measured links,
and the all-reduce's effective rate over its slowest link's shaped rate, to set MODEL_BAND and
EFFICIENCY_BAND from their spread. Stragglers (issue 36): per run, the threshold calibrated on a clean job,
false alarms in a second clean job judged with it, and the steps until a slow rank is caught. torchrun
against the supervisor: the same kill's fault-to-next-step time under each, for elastic.RESTART_BAND.
Checkpoint intervals: per run, measured over modelled goodput at each of labkit.interval_runs' three
intervals, for AGREEMENT_BAND, and which was best.
Prints figures; asserts nothing about noise.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from labkit import (elastic, fabric, fault_plan, fleet_model, interval_runs, placement, placement_probe, profile, recovery,
                    recovery_rank, recovery_report, stragglers)
from labkit.devices import describe_machine, load_average


def recovery_from_kills(work: Path, kills: int, warm_standby: bool,
                        steps_between_kills: int) -> list[recovery_report.DetectionRow]:
    """Kills spaced so that a warm standby process has time to boot between them."""
    size = {**profile().pick(recovery.SIZES).train_kwargs(), "steps": (kills + 1) * steps_between_kills}
    plan = [fault_plan.Fault("kill", i % 2, (i + 1) * steps_between_kills + 5) for i in range(kills)]
    report = recovery.supervise(work / f"kills-warm-{warm_standby}", world_size=2, spares=kills, faults=plan,
                                warm_standby=warm_standby, **size)
    rows = report.detection_table()
    assert report.recovered == sorted(f.fault_id for f in plan) and report.leftover_pids == []
    return rows


def simulator_speed() -> dict[str, float]:
    fleet = fleet_model.uniform_fleet(2, 5, 125, seed=0)
    jobs = fleet_model.generate_jobs(1000, seed=1)
    timings = {}
    for policy in placement.POLICIES:
        start = time.perf_counter()
        placement.simulate(fleet, jobs, policy, seed=1)
        timings[policy] = time.perf_counter() - start
    return timings


def placement_on_fabric(repeats: int) -> None:
    """The same job in one zone and across zones, ``repeats`` times: the spread the notebook's bands must hold."""
    capability = fabric.probe()
    print(f"placement on real links: {capability.mode} ({capability.reason})")
    if capability.mode != "namespaces":
        return
    ratios: dict[str, list[float]] = {}
    for repeat in range(repeats):
        runs = placement_probe.measure_placements()
        on_fabric = placement_probe.fleet_links(runs, scale=1)
        for run in runs:
            ratio = run.step_s / placement_probe.model_step_s(run, on_fabric)
            ratios.setdefault(run.placement, []).append(ratio)
            print(f"repeat {repeat}: {run.describe()}; measured/model {ratio:.3f}, link efficiency {run.link_efficiency:.3f}")
    for name, values in ratios.items():
        print(f"{name}: measured/model step over {len(values)} repeats: {min(values):.3f}-{max(values):.3f} "
              f"(MODEL_BAND {placement_probe.MODEL_BAND})")


def straggler_detection(work: Path, runs: int) -> None:
    """Per run: a clean job the threshold is calibrated on, a second clean job judged with it (any alarm
    there is false), and a job whose node turns slow, judged with it; ``runs`` times."""
    size = profile().pick(recovery.SIZES).train_kwargs()
    caught, false_alarms, worst, factors, seen = [], 0, [], [], []
    for run in range(runs):
        clean = recovery.supervise(work / "clean", world_size=2, spares=0, max_restarts=0, **size)
        rule = stragglers.calibrated(clean)
        slowdown = stragglers.slowdown_to_show(rule)
        held_out = recovery.supervise(work / "held-out", world_size=2, spares=3, straggler=rule, **size)
        fault = fault_plan.Fault("straggle", rank=run % 2, step=20)
        slow = recovery.supervise(work / "straggle", world_size=2, spares=1, faults=[fault], straggler=rule,
                                  straggle_slowdown=slowdown, **size)
        detection = next((d for d in slow.detections if d.fault_id == fault.fault_id), None)
        caught.append(slow.steps_to_verdict(detection) if detection else None)
        acted = slow.steps_to_detect(detection) if detection else None
        false_alarms += len(held_out.false_alarms) + len(slow.false_alarms)
        worst += [stragglers.worst_window_ratio(clean, rule), stragglers.worst_window_ratio(held_out, rule)]
        factors.append(rule.factor)
        seen.append(f"{1 + slowdown:g}x")
        print(f"run {run + 1}/{runs}: healthy jobs' widest gaps {worst[-2]:.3f} (calibration) and {worst[-1]:.3f} "
              f"(held out, {len(held_out.false_alarms)} false alarms); threshold {rule.factor:.3f}; a node doing "
              f"{1 + slowdown:g}x the work on rank {fault.rank} called after {caught[-1]} slow steps (stopped after {acted}) "
              f"({detection.detail if detection else 'missed'}); load average {load_average()}")
    found = [s for s in caught if s is not None]
    print(f"slow nodes shown: {', '.join(sorted(set(seen)))}; caught in {len(found)}/{runs} runs after "
          f"{min(found, default=0)}-{max(found, default=0)} steps (window {stragglers.StragglerRule().window}); "
          f"thresholds {min(factors):.3f}-{max(factors):.3f}; false alarms {false_alarms} over {2 * runs} judged jobs; "
          f"healthy jobs' widest gaps {min(worst):.3f}-{max(worst):.3f}")


def elastic_pairs(work: Path, pairs: int) -> None:
    """The same kill under the supervisor and under torchrun, ``pairs`` times: the spread of their restart ratio."""
    size = profile().pick(recovery.SIZES).train_kwargs()
    kill = fault_plan.Fault("kill", 1, 19)
    ratios = []
    for pair in range(pairs):
        supervised = recovery.supervise(work / "supervised", world_size=2, spares=1, faults=[kill], **size)
        detection = supervised.detections[0]
        supervisor_s = supervised.next_attempt(detection).t_first_step_end - detection.t_fault
        under_torchrun = elastic.run_torchrun(work / "torchrun", world_size=2, faults=[kill], max_restarts=1, **size)
        ratios.append(under_torchrun.fault_to_next_step_s / supervisor_s)
        print(f"pair {pair + 1}/{pairs}: {under_torchrun.describe()}; supervisor {supervisor_s:.2f} s; "
              f"ratio {ratios[-1]:.2f}; load average {load_average()}")
    print(f"torchrun / supervisor, fault to next step: {min(ratios):.2f}-{max(ratios):.2f} "
          f"(elastic.RESTART_BAND {elastic.RESTART_BAND})")


def checkpoint_intervals(runs: int) -> None:
    """Goodput at three checkpoint intervals, ``runs`` times: the spread of measured over modelled."""
    ratios, best = [], []
    for run in range(runs):
        start = time.perf_counter()
        experiment = interval_runs.measure(profile().pick(interval_runs.SIZES))
        ratios.append(experiment.ratios())
        best.append(experiment.best().factor)
        print(f"run {run + 1}/{runs} ({time.perf_counter() - start:.1f} s): goodput "
              + ", ".join(f"x{r.factor:g} {r.goodput:.3f}" for r in experiment.runs)
              + " | measured/modelled " + ", ".join(f"{ratio:.2f}" for ratio in ratios[-1])
              + f" | same weights {experiment.same_weights()} | load average {load_average()}")
    for i, factor in enumerate(interval_runs.SIZES["ci"].factors):
        column = [r[i] for r in ratios]
        print(f"x{factor:g} the optimum: measured/modelled {min(column):.2f}-{max(column):.2f}")
    print("best interval: " + ", ".join(f"x{f:g} in {best.count(f)}" for f in sorted(set(best)))
          + f" of {runs} (AGREEMENT_BAND {interval_runs.AGREEMENT_BAND})")


def torchrun_restart(work: Path) -> elastic.ElasticRun:
    """The same entry point under torchrun --max-restarts: a kill, a restart, the same weights."""
    tiny = {"steps": 12, "checkpoint_every": 4, "features": 32, "hidden": 64, "batch_size": 16}
    recovery.supervise(work / "reference", world_size=2, spares=0, **tiny)
    run = elastic.run_torchrun(work / "torchrun", world_size=2, faults=[fault_plan.Fault("kill", 1, 5)], max_restarts=1,
                               **tiny)
    same = run.returncode == 0 and recovery_rank.bit_identical(
        recovery_rank.final_weights(work / "reference"), recovery_rank.final_weights(work / "torchrun"))
    print("bit-identical to the supervisor's uninterrupted run:", same)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--steps-between-kills", type=int, default=150)
    parser.add_argument("--skip-torchrun", action="store_true")
    parser.add_argument("--fabric-repeats", type=int, default=3, help="placement runs on the fabric (0: none)")
    parser.add_argument("--only-fabric", action="store_true", help="skip recovery, simulator speed and torchrun")
    parser.add_argument("--straggler-runs", type=int, default=3, help="calibration, held-out and straggler job triples (0: none)")
    parser.add_argument("--elastic-pairs", type=int, default=0, help="supervisor + torchrun pairs, the same kill")
    parser.add_argument("--only-straggler", action="store_true", help="only the straggler and elastic runs")
    parser.add_argument("--only-intervals", type=int, default=0, metavar="RUNS",
                        help="only the checkpoint-interval experiment, RUNS times")
    args = parser.parse_args()
    print(describe_machine(), "| load average", load_average())
    if args.only_intervals:
        checkpoint_intervals(args.only_intervals)
        return
    with tempfile.TemporaryDirectory(prefix="lab08-") as tmp:
        if args.straggler_runs:
            straggler_detection(Path(tmp), args.straggler_runs)
        if args.elastic_pairs:
            elastic_pairs(Path(tmp), args.elastic_pairs)
    if args.only_straggler:
        return
    if args.fabric_repeats:
        placement_on_fabric(args.fabric_repeats)
    if args.only_fabric:
        return
    with tempfile.TemporaryDirectory(prefix="lab08-") as tmp:
        work = Path(tmp)
        for warm_standby in (False, True):
            rows = recovery_from_kills(work, args.kills, warm_standby, args.steps_between_kills)
            for row in rows:
                print(row)
            worst = max(row.recovery_s for row in rows)
            kind = "warm standby processes" if warm_standby else "cold restarts (baseline, the default)"
            print(f"{kind}: killed rank -> next training step: worst {worst:.1f} s over {len(rows)} kills "
                  "(target <= 15 s)")
        timings = simulator_speed()
        for policy, seconds in timings.items():
            print(f"simulator, 10,000 GPUs x 1,000 jobs, {policy}: {seconds:.2f} s (target <= 5 s)")
        if not args.skip_torchrun:
            print("torchrun --max-restarts 1 with a killed rank:", torchrun_restart(work).describe())


if __name__ == "__main__":
    main()
