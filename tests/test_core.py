"""The shared core: profiles, timing, the step meter, atomic writes, the op cache."""

import os
import time

import pytest
import torch

from labkit import atomic, dsops, profiles
from labkit.devices import Stopwatch, describe_machine, pick_device, time_ms
from labkit.meter import MeterSummary, StepMeter


def test_profile_defaults_to_ci_without_a_gpu(monkeypatch):
    monkeypatch.delenv("LABKIT_PROFILE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    chosen = profiles.profile()
    assert (chosen.name, chosen.device, chosen.backend, chosen.ranks) == ("ci", "cpu", "gloo", 2)


def test_env_var_overrides_detection(monkeypatch):
    monkeypatch.setenv("LABKIT_PROFILE", "ci")
    assert profiles.profile().name == "ci"


def test_unknown_profile_names_the_valid_ones(monkeypatch):
    monkeypatch.setenv("LABKIT_PROFILE", "tpu-pod")
    with pytest.raises(ValueError, match=r"one of \('ci', 'gpu', 'multi-gpu'\).*'tpu-pod'"):
        profiles.profile()


def test_gpu_profile_without_a_gpu_is_an_error_not_a_silent_cpu_run(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        profiles.profile("gpu")


def test_pick_reads_the_active_profiles_entry_and_names_missing_ones():
    ci = profiles.profile("ci")
    assert ci.pick({"ci": 1, "gpu": 2}) == 1
    with pytest.raises(KeyError, match="no entry for profile 'ci'"):
        ci.pick({"gpu": 2})


def test_pick_device_falls_back_to_cpu():
    if not torch.cuda.is_available():
        assert pick_device("cuda").type == "cpu"
    assert pick_device("cpu").type == "cpu"


def test_stopwatch_and_time_ms_measure_real_time():
    with Stopwatch("cpu") as sw:
        time.sleep(0.05)
    assert 45 <= sw.ms < 1000
    times = time_ms(lambda: time.sleep(0.01), repeats=3, warmup=0)
    assert len(times) == 3 and min(times) >= 9
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        time_ms(lambda: None, repeats=0)
    assert describe_machine()["cores"] == os.cpu_count()


def test_step_meter_splits_waiting_from_compute():
    meter = StepMeter(skip_first=0)

    def slow_batches():
        for _ in range(3):
            time.sleep(0.03)
            yield [0] * 10

    for batch in meter.iterate(slow_batches()):
        with meter.computing(len(batch)):
            time.sleep(0.01)
    summary = meter.summary()
    assert summary.steps == 3 and summary.items == 30
    assert 0.1 < summary.busy_fraction < 0.4
    assert summary.wait_ms >= 85 and summary.compute_ms >= 28
    assert summary.items_per_s < 30 / 0.12


def test_stolen_time_is_left_out_when_the_batch_was_ready_and_is_waiting_when_it_was_not():
    def steps(batches) -> MeterSummary:
        meter = StepMeter(skip_first=0)
        for batch in meter.iterate(batches):
            with meter.computing(len(batch), stolen_ms=lambda: 15.0):
                time.sleep(0.02)
        return meter.summary()

    def slow(count):
        for _ in range(count):
            time.sleep(0.03)
            yield [0] * 10

    ready = steps([[0] * 10] * 3)   # the accelerator sets the pace: stolen time is not the loader's
    assert ready.stolen_ms == 45.0 and 12 <= ready.compute_ms < 30 and ready.wait_ms < 5
    assert ready.busy_fraction > 0.8
    behind = steps(slow(3))         # the loader is behind: it would have made the accelerator wait anyway
    assert behind.stolen_ms == 45.0
    assert behind.wait_ms >= 3 * 30 + 2 * 15, "stolen time before a late batch counts as waiting"
    meter = StepMeter()
    with meter.computing(1, stolen_ms=lambda: 1e6):
        pass
    assert meter.compute_ms[-1] == 0.0 and meter.stolen_ms[-1] < 1e6, "no more is stolen than the step took"


def test_step_meter_without_steps_says_so():
    with pytest.raises(RuntimeError, match="no steps were measured"):
        StepMeter().summary()


def test_atomic_file_leaves_the_old_file_when_the_writer_fails(tmp_path):
    target = tmp_path / "state.bin"
    atomic.write_bytes_atomic(target, b"old")
    with pytest.raises(RuntimeError):
        with atomic.atomic_file(target) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("killed mid-write")
    assert target.read_bytes() == b"old"
    assert list(tmp_path.iterdir()) == [target]


def test_atomic_directory_replaces_only_when_complete(tmp_path):
    target = tmp_path / "set"
    with atomic.atomic_directory(target) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(RuntimeError):
        with atomic.atomic_directory(target) as tmp:
            (tmp / "a").write_text("2")
            raise RuntimeError("interrupted")
    assert (target / "a").read_text() == "1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["set"]


def test_stale_temporaries_of_dead_writers_are_removed(tmp_path):
    (tmp_path / ".set.tmp-999999999-abcd1234").mkdir()
    live = tmp_path / f".x.tmp-{os.getpid()}-abcd1234"
    live.write_text("mine")
    assert atomic.remove_stale_temporaries(tmp_path) == 1
    assert live.exists()


def test_a_build_lock_nobody_holds_is_stale(tmp_path):
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.write_text("")
    assert dsops.lock_holders(lock) == []
    with open(lock) as held:
        assert dsops.lock_holders(lock) == [os.getpid()]
        assert dsops.clear_stale_locks(tmp_path) == []
    assert dsops.clear_stale_locks(tmp_path) == [lock]
    assert not lock.exists()


def test_extensions_dir_is_per_environment(monkeypatch):
    import sys

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert str(dsops.use_environment_extensions_dir()).startswith(sys.prefix)


def test_ops_are_built_by_the_environments_own_ninja(monkeypatch, tmp_path):
    """Two ninja versions read each other's build log as changed commands and rebuild every op."""
    import shutil
    import sys

    env_bin = tmp_path / "venv" / "bin"
    env_bin.mkdir(parents=True)
    (env_bin / "ninja").write_text("#!/bin/sh\n")
    (env_bin / "ninja").chmod(0o755)
    other = tmp_path / "usr" / "bin"
    other.mkdir(parents=True)
    (other / "ninja").write_text("#!/bin/sh\n")
    (other / "ninja").chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(env_bin / "python"))
    monkeypatch.setenv("PATH", str(other))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    dsops.use_environment_extensions_dir()
    assert shutil.which("ninja") == str(env_bin / "ninja")
    dsops.use_environment_extensions_dir()
    assert os.environ["PATH"].split(os.pathsep).count(str(env_bin)) == 1, "added once, not once per call"


def test_gloo_ranks_build_cpu_ops_and_other_accelerators_are_refused():
    assert dsops.accelerator_for("gloo") == "cpu" and dsops.accelerator_for("nccl") is None
    assert type(dsops._builder(dsops.CPU_ADAM_OP, "cpu")).__module__.startswith("deepspeed.ops.op_builder.cpu")
    with pytest.raises(ValueError, match="accelerator must be None .* or 'cpu', got 'tpu'"):
        dsops.ensure_built((dsops.CPU_ADAM_OP,), accelerator="tpu")


def test_ranks_beyond_the_gpu_count_run_on_the_cpu():
    two_gpus = profiles.Profile("multi-gpu", device="cuda", ranks=2, rank_device="cuda", backend="nccl")
    assert two_gpus.backend_for(2) == "nccl" and two_gpus.backend_for(4) == "gloo"
    assert profiles.profile("ci").backend_for(2) == "gloo"
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        two_gpus.backend_for(0)


def test_loader_workers_follow_the_granted_cores_and_the_cap():
    from labkit.devices import loader_workers

    granted = len(os.sched_getaffinity(0))
    assert loader_workers() == min(16, granted)
    assert loader_workers(cap=1) == 1
    with pytest.raises(ValueError, match="cap must be >= 1, got 0"):
        loader_workers(cap=0)


def test_grouped_bars_draws_one_bar_per_series_and_group_and_checks_lengths():
    import matplotlib

    matplotlib.use("Agg")
    from labkit import plots

    _, (ax,) = plots.figure()
    plots.grouped_bars(ax, ["a", "b", "c"], {"x": [1.0, 2.0, 3.0], "y": [3.0, 2.0, 1.0]})
    assert len(ax.patches) == 6
    assert [text.get_text() for text in ax.get_legend().get_texts()] == ["x", "y"]
    with pytest.raises(ValueError, match="series 'y' has 2 values for 3 groups"):
        plots.grouped_bars(ax, ["a", "b", "c"], {"y": [1.0, 2.0]})


def test_cpu_ms_per_item_charges_cpu_not_waiting():
    from labkit.devices import cpu_ms_per_item

    def spin():
        end = time.process_time() + 0.02
        while time.process_time() < end:
            pass

    costs = cpu_ms_per_item({"sleep": lambda: time.sleep(0.02), "spin": spin}, items=2, repeats=2)
    assert list(costs) == ["sleep", "spin"]
    assert costs["spin"] >= 10.0 > costs["sleep"]  # 20 ms of CPU over 2 items; a sleep uses next to none
    with pytest.raises(ValueError, match="items and repeats must be >= 1, got 0 and 1"):
        cpu_ms_per_item({"spin": spin}, items=0, repeats=1)


def test_accelerator_memory_is_read_from_the_gpu_when_there_is_one(monkeypatch):
    from types import SimpleNamespace

    from labkit import devices

    h200 = SimpleNamespace(name="NVIDIA H200", total_memory=150_754_820_096)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: h200)
    total, note = devices.accelerator_memory_bytes()
    assert total == h200.total_memory
    assert "NVIDIA H200" in note and "140.4 GiB" in note


def test_without_a_gpu_the_memory_is_a_stated_80_gib_reference(monkeypatch):
    from labkit import devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    total, note = devices.accelerator_memory_bytes()
    assert total == 80 * 2**30
    assert note.startswith("no GPU here") and "80 GiB" in note


def test_the_shared_mlp_has_the_widths_asked_for_and_refuses_impossible_ones():
    from labkit import models

    model = models.mlp([8, 16, 4], seed=0)
    assert [layer.out_features for layer in model if isinstance(layer, torch.nn.Linear)] == [16, 4]
    assert sum(p.numel() for p in model.parameters()) == models.parameter_count([8, 16, 4])
    assert torch.equal(model[0].weight, models.mlp([8, 16, 4], seed=0)[0].weight), "a seed fixes the weights"
    with pytest.raises(ValueError, match="widths must be two or more sizes >= 1"):
        models.mlp([8])
    with pytest.raises(ValueError, match="widths must be two or more sizes >= 1"):
        models.mlp([8, 0, 4])


def test_peak_rss_sees_memory_touched_and_released_inside_the_block():
    import mmap

    from labkit.devices import PeakRss

    size = 64 * 2**20
    with PeakRss() as peak:
        # fresh pages from the kernel, one byte written in each: memory that malloc kept from an
        # earlier test can be reused without growing the resident set (CI once saw 0 bytes with np.ones)
        touched = mmap.mmap(-1, size)
        for offset in range(0, size, mmap.PAGESIZE):
            touched[offset] = 1
        touched.close()
    assert peak.added_bytes >= 60 * 2**20, "the high-water mark keeps a peak that is already gone"


def test_a_rank_runs_on_its_gpu_under_nccl_and_on_the_cpu_under_gloo(monkeypatch):
    from labkit.launcher import rank_device

    monkeypatch.setenv("LABKIT_BACKEND", "nccl")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert rank_device() == torch.device("cuda", 1)
    monkeypatch.setenv("LABKIT_BACKEND", "gloo")
    assert rank_device() == torch.device("cpu")


HOLD_A_TEMPORARY_FOLDER = """
import sys, time
from labkit.processes import temporary_folder
with temporary_folder("labkit-test-", sys.argv[1]) as folder:
    (folder / "swap").write_bytes(b"x" * 4096)
    print(folder, flush=True)
    time.sleep(60)
"""


@pytest.mark.parametrize("stop", ["sigterm", "exception"])
def test_a_temporary_folder_is_removed_when_its_program_is_stopped(tmp_path, stop):
    """What `labkit run` does to a lab it stops: SIGTERM; the folder must not outlive the lab."""
    import signal
    import subprocess
    import sys

    from labkit.processes import temporary_folder

    if stop == "exception":
        with pytest.raises(RuntimeError), temporary_folder("labkit-test-", tmp_path) as folder:
            raise RuntimeError("a cell failed")
        assert not folder.exists()
        return
    proc = subprocess.Popen([sys.executable, "-c", HOLD_A_TEMPORARY_FOLDER, str(tmp_path)], stdout=subprocess.PIPE,
                            text=True)
    try:
        folder = proc.stdout.readline().strip()
        assert folder and os.path.isdir(folder)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 128 + signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
    assert list(tmp_path.iterdir()) == []


def test_cpu_info_is_probed_once_per_cpu_and_kept_in_the_ops_folder(monkeypatch, tmp_path):
    cpuinfo = pytest.importorskip("cpuinfo")
    monkeypatch.setenv(dsops.ENV_VAR, str(tmp_path))
    probes = []

    def install(answer: str) -> None:   # what a new process does: the probe, then labkit's cache around it
        monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: probes.append(answer) or {"vendor_id_raw": answer})
        dsops.cache_cpu_info()

    install("x")
    dsops.cache_cpu_info()   # a second install must not wrap the cache again
    assert cpuinfo.get_cpu_info() is cpuinfo.get_cpu_info()
    assert probes == ["x"]
    assert [p.name for p in tmp_path.iterdir()] == [dsops.cpu_info_file().name]
    install("y")   # a later process on this CPU reads the file
    assert cpuinfo.get_cpu_info() == {"vendor_id_raw": "x"} and probes == ["x"]
    dsops.cpu_info_file().write_text("{torn")   # a damaged file: probe again
    install("z")
    assert cpuinfo.get_cpu_info() == {"vendor_id_raw": "z"} and probes == ["x", "z"]
    monkeypatch.setattr(dsops, "cpu_info_file", lambda: tmp_path / "cpuinfo-another-cpu.json")
    install("w")   # another CPU: its own file
    assert cpuinfo.get_cpu_info() == {"vendor_id_raw": "w"} and probes == ["x", "z", "w"]


def test_each_process_runs_a_lab_in_its_own_folder_and_the_next_run_removes_ended_ones(tmp_path, monkeypatch):
    """Two copies of one lab at once (a notebook beside ``labkit run``) must not remove each other's files."""
    import subprocess
    import sys

    from labkit.paths import run_dir

    monkeypatch.setenv("LABKIT_DATA", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    ended, live = tmp_path / "labx" / f"run-{dead.pid}", tmp_path / "labx" / f"run-{os.getppid()}"
    for folder in (ended, live):
        folder.mkdir(parents=True)
        (folder / "checkpoint").write_text("kept while its process runs")
    mine = run_dir("labx")
    assert mine == tmp_path / "labx" / f"run-{os.getpid()}" and list(mine.iterdir()) == []
    assert not ended.exists() and (live / "checkpoint").exists()
    (mine / "checkpoint").write_text("this run's")
    assert run_dir("labx") == mine and list(mine.iterdir()) == [], "a second run in one process starts afresh"
    (mine / "checkpoint").write_text("this run's")
    other = subprocess.run([sys.executable, "-c", "from labkit.paths import run_dir; print(run_dir('labx'))"],
                           capture_output=True, text=True, timeout=60, env={**os.environ, "LABKIT_DATA": str(tmp_path)})
    assert other.stdout.strip() not in ("", str(mine)), other.stderr[-2000:]
    assert (mine / "checkpoint").read_text() == "this run's", "another process's run left this one's files alone"
