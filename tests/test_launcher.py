"""Real ranks: results in order, failures loud, hangs bounded, nothing left behind."""

import concurrent.futures
import os
import time

import pytest

from labkit.launcher import RankError, RankTimeout, launch
from labkit.processes import running
from tests import rankfns


@pytest.fixture()
def short_tmp():
    """A temp dir short enough for a fork server's socket: pytest-xdist's ``tmp_path`` is not.

    Under ``tmp_path`` in a worker (``.../popen-gw0/<test name>0``) a socket path would pass
    ``AF_UNIX_PATH_MAX``, so :func:`labkit.processes.multiprocessing_base_dir` falls back to
    /tmp, where other programs' folders are: the test would read theirs.
    """
    import shutil
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.mkdtemp(prefix="lkt-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_ranks_run_a_real_all_reduce_with_one_thread_each():
    results = launch(rankfns.allreduce_rank, 2, value=1.0, timeout_s=120)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["sum"] == 3.0 for r in results)
    assert all(r["threads"] == 1 for r in results)


def test_the_launcher_holds_the_ranks_store_before_any_rank_starts():
    # a port chosen free, released, and bound later by rank 0 could be taken in between by another launch
    assert launch(rankfns.store_is_listening_rank, 2, init_process_group=False, timeout_s=120) == [True, True]


def test_two_launches_at_once_each_meet_their_own_ranks():
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(launch, rankfns.allreduce_rank, 2, value=float(v), timeout_s=120) for v in range(1, 7)]
        sums = [[r["sum"] for r in run.result()] for run in runs]
    assert sums == [[3.0 * v] * 2 for v in range(1, 7)]


def test_a_failing_rank_is_reraised_with_its_traceback():
    with pytest.raises(RankError, match="rank 1 failed") as info:
        launch(rankfns.failing_rank, 2, bad_rank=1, timeout_s=120)
    assert "rank 1 was told to fail" in info.value.remote_traceback
    assert "rankfns.py" in info.value.remote_traceback


def test_a_hung_rank_times_out_and_no_rank_survives(tmp_path):
    # 5 s: ranks forked from the fork server write their pid files well within it (a two-rank launch takes 0.05 s)
    with pytest.raises(RankTimeout, match=r"ranks \[0, 1\] did not finish within timeout_s=5s"):
        launch(rankfns.hanging_rank, 2, timeout_s=5, pid_dir=str(tmp_path))
    time.sleep(0.5)
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 2
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)


def test_ranks_see_the_callers_environment_and_folder_of_now_not_the_fork_servers(tmp_path, monkeypatch):
    """The fork server started with the first launch; what the caller changed since must reach the ranks."""
    launch(rankfns.allreduce_rank, 2, value=1.0)   # the server is up from here on
    monkeypatch.setenv("LABKIT_TEST_SET_LATER", "yes")
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.chdir(tmp_path)
    assert launch(rankfns.env_rank, 2, name="LABKIT_TEST_SET_LATER") == [("yes", str(tmp_path))] * 2
    assert launch(rankfns.env_rank, 2, name="HOME") == [(None, str(tmp_path))] * 2


def test_no_rank_leaves_its_group_before_every_rank_has_finished():
    """A rank that left while a peer was still connecting gloo's mesh made the peer fail ("Connection closed
    by peer"), for a function with no collective in it: the ranks leave together."""
    assert launch(rankfns.first_done_still_runs_rank, 2, wait_s=1.0, timeout_s=60) == [None, True]


def test_functions_from_a_notebook_cell_are_refused_with_the_fix():
    def local_fn():
        return 1

    with pytest.raises(ValueError, match="importable module"):
        launch(local_fn, 2)


@pytest.mark.parametrize("bad", [dict(world_size=0), dict(world_size=2, timeout_s=0), dict(world_size=2, backend="mpi")])
def test_bad_launch_arguments_name_the_argument(bad):
    world_size = bad.pop("world_size")
    with pytest.raises(ValueError, match="world_size|timeout_s|backend"):
        launch(rankfns.allreduce_rank, world_size, value=1.0, **bad)


def test_gloo_ranks_get_deepspeeds_cpu_accelerator_even_when_told_otherwise():
    """On a GPU machine DeepSpeed would pick CUDA; a gloo rank is a CPU rank whatever the env says."""
    results = launch(rankfns.deepspeed_accelerator_rank, 2, env={"DS_ACCELERATOR": "cuda"}, timeout_s=120)
    assert results == [("cpu", "cpu"), ("cpu", "cpu")]


def test_launch_refuses_an_unknown_backend_naming_the_valid_ones():
    with pytest.raises(ValueError, match="backend must be 'gloo' .* or 'nccl' .*, got 'mpi'"):
        launch(rankfns.deepspeed_accelerator_rank, 1, backend="mpi")


def test_a_successful_launch_removes_its_log_folder(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    launch(rankfns.allreduce_rank, 2, value=1.0, timeout_s=120)
    assert not list(tmp_path.glob("labkit-ranks-*"))


def test_a_failed_launch_keeps_its_logs_and_names_the_folder(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(RankError, match="full output is kept in") as info:
        launch(rankfns.failing_rank, 2, bad_rank=0, timeout_s=120)
    kept = list(tmp_path.glob("labkit-ranks-*"))
    assert len(kept) == 1 and str(kept[0]) in str(info.value)


def test_kill_group_stops_a_process_that_never_made_its_own_group():
    import subprocess

    from labkit.processes import kill_group

    child = subprocess.Popen(["sleep", "60"])  # shares our process group, as a rank does before setpgrp
    kill_group(child.pid, grace_s=1)
    assert child.wait(timeout=5) != 0


def test_a_rank_dies_with_its_parent(tmp_path):
    """A kernel killed hard (SIGKILL) must not leave its ranks running: they die with it."""
    import signal
    import subprocess
    import sys

    code = ("import sys; from labkit.launcher import launch; from tests import rankfns; "
            f"launch(rankfns.hanging_rank, 2, timeout_s=120, pid_dir={str(tmp_path)!r})")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=os.path.dirname(os.path.dirname(__file__)))
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("*.pid"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 2, "ranks did not start"
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 5
    while [pid for pid in pids if running(pid)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if running(pid)]


def test_log_and_fork_server_folders_of_dead_launchers_are_swept_up(short_tmp, monkeypatch):
    import subprocess
    import tempfile

    from labkit.launcher import LOG_DIR_PREFIX, remove_stale_dirs
    from labkit.processes import MP_DIR_PREFIX

    monkeypatch.setattr(tempfile, "tempdir", str(short_tmp))
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = [short_tmp / f"{LOG_DIR_PREFIX}{dead.pid}-abc", short_tmp / f"{MP_DIR_PREFIX}{dead.pid}-abc"]
    mine = [short_tmp / f"{LOG_DIR_PREFIX}{os.getpid()}-def", short_tmp / f"{MP_DIR_PREFIX}{os.getpid()}-def"]
    for folder in stale + mine:
        folder.mkdir()
    assert sorted(remove_stale_dirs()) == sorted(stale)
    assert all(f.exists() for f in mine) and not any(f.exists() for f in stale)


KILLED_LAUNCHER = """
import multiprocessing.util, os
from labkit.launcher import launch
from tests.rankfns import env_rank
launch(env_rank, 1, name="HOME")
print(multiprocessing.util.get_temp_dir(), flush=True)
os.kill(os.getpid(), 9)
"""


def test_a_killed_launchers_fork_server_folder_is_named_for_it_and_swept(short_tmp, monkeypatch):
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from labkit.launcher import remove_stale_dirs
    from labkit.processes import MP_DIR_PREFIX

    # A kernel stopped by SIGKILL runs no exit hook: multiprocessing's own pymp-* folder stayed for good.
    done = subprocess.run([sys.executable, "-c", KILLED_LAUNCHER], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parent.parent, env={**os.environ, "TMPDIR": str(short_tmp)})
    folder = Path(done.stdout.strip())
    assert folder.name.startswith(MP_DIR_PREFIX) and folder.parent == short_tmp, done.stdout + done.stderr[-3000:]
    assert folder.exists(), "SIGKILL leaves the folder behind"
    monkeypatch.setattr(tempfile, "tempdir", str(short_tmp))
    assert folder in remove_stale_dirs()
    assert not folder.exists()


def test_the_fork_server_folder_leaves_room_for_its_socket_under_a_long_temp_dir(tmp_path, monkeypatch):
    import tempfile

    from labkit.processes import AF_UNIX_PATH_MAX, multiprocessing_base_dir

    monkeypatch.setattr(tempfile, "tempdir", "/tmp/" + "x" * 80)
    assert multiprocessing_base_dir() == "/tmp"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path.parent.parent))
    assert len(multiprocessing_base_dir()) + 45 <= AF_UNIX_PATH_MAX
