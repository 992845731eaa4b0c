"""`labkit diagnose`: a step split into the course's bottlenecks, each instant counted once; bad input named."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest

from labkit import diagnosis_report, step_attribution as sa

SCRIPT = Path(__file__).parent / "scripts" / "ddp_train.py"


def _x(name, ts, dur, tid=1, cat="cpu_op", **args):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1, "cat": cat, "args": args}


def test_intervals_are_merged_and_subtracted():
    assert sa.union([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]
    assert sa.subtract([(0, 10)], [(2, 3), (5, 12)]) == [(0, 2), (3, 5)]
    assert sa.length(sa.clip([(0, 10), (20, 30)], (5, 25))) == 10


def test_each_instant_of_a_cpu_step_is_counted_once_and_a_hidden_collective_is_not_communication():
    events = [
        _x("ProfilerStep#3", 0, 100, cat="user_annotation"),
        _x("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 0, 40, cat="user_annotation"),
        _x("aten::stack", 10, 20),                      # inside the loader: data, not compute
        _x("aten::addmm", 40, 30, flops=1000),          # compute
        _x("c10d::allreduce_", 70, 2),                  # the training thread calls the process group
        _x("gloo:all_reduce", 65, 25, tid=2, cat="user_annotation"),  # 65-70 hidden by compute, 70-90 exposed
        _x(sa.CHECKPOINT_SPAN + " (torch.save)", 90, 5, cat="user_annotation"),
        _x("aten::copy_", 91, 3),                       # inside the save: checkpoint
    ]
    step = sa.attribute_rank({"traceEvents": events}, 0).steps[0]
    assert step.step == 3 and step.step_ms == pytest.approx(0.1)
    assert step.shares == pytest.approx({"data": 0.40, "host_to_device": 0.0, "compute": 0.30,
                                         "communication": 0.20, "checkpoint": 0.05, "other": 0.05})


def test_on_a_gpu_kernels_are_compute_copies_are_host_to_device_and_nccl_is_communication():
    events = [
        _x("ProfilerStep#0", 0, 100, cat="user_annotation"),
        _x("aten::mm", 0, 100),                          # the host thread's op: not compute when kernels exist
        _x("Memcpy HtoD (Pageable -> Device)", 0, 10, tid=7, cat="gpu_memcpy"),
        _x("sm90_xmma_gemm_bf16", 10, 50, tid=7, cat="kernel"),
        _x("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 40, 40, tid=8, cat="kernel"),  # 60-80 exposed
        _x("nccl:all_reduce", 40, 1, cat="user_annotation"),  # the host's launch of it: not the communication
        _x("enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__", 50, 40, cat="user_annotation"),
    ]                                                    # 50-80 hidden by the device's work, 80-90 data
    shares = sa.attribute_rank({"traceEvents": events}, 0).steps[0].shares
    assert shares == pytest.approx({"data": 0.10, "host_to_device": 0.10, "compute": 0.50,
                                    "communication": 0.20, "checkpoint": 0.0, "other": 0.10})


RECORDED_GPU_TRACE = Path(__file__).parent / "data" / "hta" / "sampled_rank-0.json.gz"


def test_a_trace_a_gpu_recorded_is_split_as_the_device_spent_each_microsecond():
    """HTA's recorded rank of a 128-GPU NCCL job (tests/data/hta/README.md), checked against a raster of its kernels."""
    trace = json.loads(gzip.decompress(RECORDED_GPU_TRACE.read_bytes()))
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    rank = sa.attribute_rank(trace, 0)
    recorded = sorted((e for e in events if e["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"])
    assert [(s.step, s.step_ms) for s in rank.steps] == [(int(e["name"].split("#")[1]), e["dur"] / 1e3)
                                                        for e in recorded] == [(551, 607.312), (552, 622.928)]
    for step, span in zip(rank.steps, recorded):
        start, end = int(span["ts"]), int(span["ts"] + span["dur"])   # whole microseconds in this trace

        def busy(keep) -> np.ndarray:   # one flag per microsecond of the step
            flags = np.zeros(end - start, dtype=bool)
            for e in events:
                if keep(e) and e["ts"] < end and e["ts"] + e["dur"] > start:
                    flags[int(max(e["ts"], start)) - start:int(min(e["ts"] + e["dur"], end)) - start] = True
            return flags

        compute = busy(lambda e: e.get("cat") == "kernel" and not e["name"].startswith("nccl"))
        copies = busy(lambda e: e.get("cat") == "gpu_memcpy" and "HtoD" in e["name"]) & ~compute
        nccl = busy(lambda e: e.get("cat") == "kernel" and e["name"].startswith("nccl")) & ~compute & ~copies
        assert step.shares == pytest.approx({"data": 0.0, "host_to_device": copies.mean(), "compute": compute.mean(),
                                             "communication": nccl.mean(), "checkpoint": 0.0,
                                             "other": 1 - compute.mean() - copies.mean() - nccl.mean()}, abs=1e-6)
        assert step.shares["communication"] > 0.2 and step.shares["host_to_device"] > 0
    assert rank.memory_bound_share_of_compute is None, "kernels carry no FLOPs: not split by the roofline"


def test_an_op_below_the_ridge_is_memory_bound_and_a_wrapper_without_flops_is_not_counted_over_its_matmul():
    shapes = {"Input Dims": [[1024, 1024], [1024, 1024]], "Input type": ["float", "float"]}
    matmul = _x("aten::mm", 10, 50, flops=2 * 1024**3, **shapes)   # 2 GFLOP over 8 MiB: 256 FLOP/byte
    assert not sa.memory_bound(matmul, ridge_flop_per_byte=100) and sa.memory_bound(matmul, ridge_flop_per_byte=300)
    events = [_x("ProfilerStep#1", 0, 100, cat="user_annotation"), _x("aten::linear", 0, 60), matmul,
              _x("aten::relu", 60, 20)]
    rank = sa.attribute_rank({"traceEvents": events}, 0, ridge_flop_per_byte=100)
    assert rank.memory_bound_share_of_compute == pytest.approx(30 / 80)   # linear's own 10 + relu's 20


def test_waiting_for_an_accelerator_in_another_process_is_compute_on_the_cpu():
    events = [
        _x("ProfilerStep#1", 0, 100, cat="user_annotation"),
        _x("enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__", 0, 60, cat="user_annotation"),
        _x(sa.ACCELERATOR_SPAN, 60, 38, cat="user_annotation"),
        _x("aten::copy_", 61, 2),                       # the batch into the accelerator's buffer
    ]
    step = sa.attribute_rank({"traceEvents": events}, 0).steps[0]
    assert step.shares["data"] == pytest.approx(0.60) and step.shares["compute"] == pytest.approx(0.38)
    assert step.shares["other"] == pytest.approx(0.02)
    assert step.memory_bound_ms == pytest.approx(0.002), "only the copy on this thread is split by the roofline"


def test_a_trace_without_steps_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="ProfilerStep spans on one thread, found them on 0"):
        sa.attribute_rank({"traceEvents": [_x("aten::mm", 0, 1)]}, 0)


def test_the_verdict_names_the_largest_share_and_the_lab_that_treats_it():
    shares = dict.fromkeys(sa.CATEGORIES, 0.1) | {"communication": 0.5}
    found = diagnosis_report.verdict(shares)
    assert (found.bottleneck, found.share) == ("communication", 0.5) and found.lab.startswith("Lab 5")
    with pytest.raises(ValueError, match="missing"):
        diagnosis_report.verdict({"data": 1.0})


def test_summary_weights_ranks_by_step_time_and_finds_the_straggler():
    def rank(r, ms, data):
        return {"rank": r, "step_ms": ms, "unprofiled_step_ms": ms, "memory_bound_share_of_compute": 0.5,
                "shares": dict.fromkeys(sa.CATEGORIES, 0.0) | {"data": data, "compute": 1 - data}}
    summary = diagnosis_report.summarise([rank(0, 10.0, 0.2), rank(1, 30.0, 0.6)])
    assert summary["shares"]["data"] == pytest.approx(0.5) and summary["slowest_rank"] == 1
    assert summary["step_spread"] == pytest.approx(3.0) and summary["verdict"]["bottleneck"] in ("data", "compute")


def _leftovers(before: set) -> list[str]:
    return sorted(set(map(str, _children())) - set(map(str, before)))


def _children() -> set:
    """Processes this test started, and torchrun's temp folders (it makes one unless given --log-dir)."""
    import glob
    import tempfile

    return ({p.pid for p in psutil.Process().children(recursive=True)}
            | set(glob.glob(f"{tempfile.gettempdir()}/torchelastic_*")))


@pytest.mark.parametrize("nproc", [0, 10_000])
def test_more_ranks_than_the_machine_has_is_refused(tmp_path, nproc):
    with pytest.raises(ValueError, match=r"--nproc must be in 1\.\.\d+"):
        diagnosis_report.launch(SCRIPT, [], out=tmp_path, nproc=nproc)


def test_a_missing_script_is_named(tmp_path):
    with pytest.raises(ValueError, match="SCRIPT .*nope.py is not a file"):
        diagnosis_report.launch(tmp_path / "nope.py", [], out=tmp_path)


@pytest.mark.slow
def test_a_script_that_crashes_shows_its_traceback_and_leaves_nothing(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text("raise RuntimeError('the learner script broke')\n")
    before = _children()
    with pytest.raises(ValueError, match=r"(?s)failed on its ranks.*RuntimeError: the learner script broke"):
        diagnosis_report.launch(script, [], out=tmp_path / "out", timeout_s=120)
    assert not _leftovers(before)


@pytest.mark.slow
def test_a_script_that_never_steps_times_out_naming_the_optimizer_and_leaves_nothing(tmp_path):
    script = tmp_path / "loops.py"
    script.write_text("import time\nwhile True:\n    time.sleep(0.1)\n")
    before = _children()
    with pytest.raises(ValueError, match=r"did not finish 12 profiled optimizer steps in 3 s; does it call "
                                         r"optimizer.step\(\)"):
        diagnosis_report.launch(script, [], out=tmp_path / "out", steps=10, warmup=2, timeout_s=3)
    assert not _leftovers(before)


@pytest.mark.alone  # shares of a step's time
@pytest.mark.slow
def test_two_ranks_of_a_starving_loader_are_diagnosed_data_bound_from_the_command_line(tmp_path):
    out = tmp_path / "diag"
    before = _children()
    done = subprocess.run([sys.executable, "-m", "labkit.course.cli", "diagnose", "--nproc", "2", "--steps", "4",
                           "--out", str(out), "--", str(SCRIPT), "3"], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "diagnosis.json").read_text())
    assert summary["verdict"]["bottleneck"] == "data", done.stdout
    assert sum(summary["shares"].values()) == pytest.approx(1.0)
    assert {r["rank"] for r in summary["ranks"]} == {0, 1} and (out / "diagnosis.png").exists()
    assert all((out / f"trace-rank{r}.json").exists() for r in (0, 1))
    assert not _leftovers(before)
    assert "Verdict: data takes" in done.stdout and "Profiler overhead" in done.stdout


@pytest.mark.parametrize("link_gbit, nproc, says", [(0.0, 2, "--link-gbit must be a rate > 0"),
                                                    (1.0, 1, "--link-gbit needs --nproc 2 or more")])
def test_a_shaped_link_needs_a_rate_and_two_ranks(tmp_path, link_gbit, nproc, says):
    with pytest.raises(ValueError, match=says):
        diagnosis_report.launch(SCRIPT, [], out=tmp_path, nproc=nproc, link_gbit=link_gbit)


@pytest.mark.alone  # a band around the ring model's time
@pytest.mark.slow
def test_on_a_slow_shaped_link_the_step_waits_for_the_gradient_as_long_as_the_ring_model_says(tmp_path):
    from labkit import fabric

    if fabric.probe().mode != "namespaces":
        pytest.skip(f"no shaped links here: {fabric.probe().reason}")
    before = _children()
    summary = diagnosis_report.summarise(diagnosis_report.launch(SCRIPT, ["0"], out=tmp_path, nproc=2, steps=4,
                                                                 link_gbit=0.1, timeout_s=180))
    assert summary["verdict"]["bottleneck"] == "communication"
    gradient_bytes = (256 * 1024 + 1024 + 1024 * 10 + 10) * 4   # the script's MLP; 2 ranks: the ring sends it once
    link_ms = gradient_bytes * 8 / 0.1e9 * 1e3
    measured_ms = summary["shares"]["communication"] * summary["step_ms"]
    assert 0.8 <= measured_ms / link_ms <= 1.4, (measured_ms, link_ms)
    from labkit.netns import NETNS_DIR

    assert not _leftovers(before) and not [n for n in os.listdir(NETNS_DIR) if n.startswith(f"lk-{os.getpid()}-")]


@pytest.mark.slow
def test_the_python_api_profiles_a_loop_in_this_process_and_lets_it_go_on(tmp_path):
    import torch

    from labkit.diagnose import Diagnosis

    sys.path.insert(0, str(SCRIPT.parent))
    from ddp_train import SlowDataset

    model = torch.nn.Linear(256, 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(SlowDataset(400, 0.005), batch_size=8)
    steps, threads = 0, torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run: a thread pool on a loaded 2-core box stretches tiny ops
    with Diagnosis(tmp_path, steps=4, warmup=1, baseline_steps=3) as diagnosis:
        for x, y in loader:
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
            if steps == 12:
                break
    torch.set_num_threads(threads)
    assert steps == 12, "the loop runs on after the profiled steps"
    result = diagnosis.result
    assert max(result.shares, key=result.shares.get) == "data" and result.shares["data"] > 0.5
    assert result.state_bytes.parameters == (256 * 10 + 10) * 4 and result.state_bytes.optimizer_state == 0
    assert json.loads((tmp_path / "rank0.json").read_text())["trace"] == "trace-rank0.json"


def test_a_loop_without_an_optimizer_marks_its_own_steps(tmp_path):
    import time

    import torch

    from labkit.diagnose import Diagnosis

    with pytest.raises(RuntimeError, match="steps_from_optimizer=False"):
        Diagnosis(tmp_path / "hooked").step()
    marked = 0
    with Diagnosis(tmp_path, steps=2, warmup=1, baseline_steps=2, steps_from_optimizer=False) as probe:
        for _ in range(8):
            with torch.profiler.record_function(sa.ACCELERATOR_SPAN):
                time.sleep(0.01)   # the accelerator's process computes; this thread waits
            probe.step()
            marked += 1
    assert marked == 8 and probe.steps_seen == 5, "marks stop counting once the profiled steps are recorded"
    assert max(probe.result.shares, key=probe.result.shares.get) == "compute"
    assert probe.result.state_bytes is None, "no optimizer on this thread to read the state from"


def test_the_profiled_window_is_asked_for_only_once_its_steps_have_ended(tmp_path):
    from labkit import diagnose

    probe = diagnose.Diagnosis(tmp_path, steps=2, warmup=1, baseline_steps=2)
    with pytest.raises(RuntimeError, match="profiled steps have not ended: 0 steps seen, 5 needed"):
        probe.profiled_window
    probe._marks = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert probe.profiled_window == (3.0, 5.0), "steps 3 and 4, after 2 unprofiled and 1 warm-up"
