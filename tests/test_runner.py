"""`labkit run`: lab selection, a report that shows failures, clear errors."""

import json

import pytest

from labkit.course import cli, results
from labkit.course import LABS, select
from labkit.course.runner import LabRun, check_out_dir, write_report


def test_select_accepts_numbers_slugs_and_all():
    assert [lab.number for lab in select(["3", "05", "zero_memory"])] == [3, 5, 4]
    assert select(["all"]) == list(LABS)


def test_unknown_lab_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown lab '99'; choose from: all, 1 \(input_pipeline\)"):
        select(["99"])


def test_report_shows_the_failing_lab_with_its_error(tmp_path):
    figure = results.Figure(1, "training speed of the fix", 31.5, "x", reported="7.3x (a shorter job)")
    runs = [LabRun(LABS[0], True, 12.0, figures=[figure]), LabRun(LABS[1], False, 3.0, error="AssertionError: boom")]
    md, html = write_report(runs, tmp_path)
    text = md.read_text()
    assert "| 1 input_pipeline | passed |" in text and "31.5" in text and "7.3x (a shorter job)" in text
    assert "**FAILED**" in text and "AssertionError: boom" in text and "1 of 2 labs passed" in text
    assert "AssertionError: boom" in html.read_text()


def test_report_keeps_measured_modelled_and_chosen_figures_apart_and_context_out_of_the_comparison(tmp_path):
    figures = [results.Figure(8, "goodput, toy run", 0.02, "", "measured"),
               results.Figure(8, "goodput at Llama 3's failure rate", 0.99, "", "modelled",
                              basis="Young/Daly from this run's restart cost", reported="over 0.90 (Llama 3)"),
               results.Figure(8, "link rate", 0.1, "Gbit/s", "setting", basis="a slow link between zones"),
               results.Figure(8, "speedup", 2.0, "x", context="Khanna: jobs kept inside one zone")]
    md, html = write_report([LabRun(LABS[7], True, 40.0, figures=figures)], tmp_path)
    row = next(line for line in md.read_text().splitlines() if line.startswith("| 8 "))
    measured, modelled, setting, reported = (cell.strip() for cell in row.split("|")[4:8])
    assert "goodput, toy run" in measured and "Llama" not in measured and "link rate" not in measured
    assert modelled.startswith("goodput at Llama 3's failure rate: 0.99") and setting == "link rate: 0.1 Gbit/s"
    assert reported == "goodput at Llama 3's failure rate: over 0.90 (Llama 3)"
    text = md.read_text()
    assert "Khanna: jobs kept inside one zone" in text.split(row)[1], "context is a footnote, below the table"
    assert "Young/Daly from this run's restart cost" in text and "Khanna" in html.read_text()
    data = json.loads((tmp_path / "report.json").read_text())
    assert [f["kind"] for f in data["labs"][0]["figures"]] == ["measured", "modelled", "setting", "measured"]


def test_unwritable_out_dir_is_named(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="--out .* is not a writable folder"):
        check_out_dir(blocker / "sub")


def test_cli_rejects_unknown_profiles_and_labs(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "--profile", "tpu"])
    assert "profile must be one of" in capsys.readouterr().err
    assert cli.main(["run", "nope", "--out", "/tmp/labkit-test-out"]) == 2


def test_record_writes_only_when_collected(tmp_path, monkeypatch):
    monkeypatch.delenv(results.ENV_VAR, raising=False)
    assert results.record(2, "x", 1.0).value == 1.0
    target = tmp_path / "f.jsonl"
    monkeypatch.setenv(results.ENV_VAR, str(target))
    results.record(2, "speedup", 1.5, "x", reported="1.4x (Eventual)")
    results.record(2, "stand-in rate", 3.0, "x", kind="setting", basis="3x the decode rate")
    assert results.read(target) == [results.Figure(2, "speedup", 1.5, "x", reported="1.4x (Eventual)"),
                                    results.Figure(2, "stand-in rate", 3.0, "x", "setting", "3x the decode rate")]


@pytest.mark.parametrize("kwargs, message", [
    (dict(lab=9), "lab must be in 1..8"),
    (dict(value=float("nan")), "must be finite"),
    (dict(kind="guessed"), "kind must be one of"),
    (dict(kind="modelled"), "needs basis=: the model and the measured inputs"),
    (dict(kind="setting"), "needs basis=: why the lab chose"),
    (dict(kind="setting", basis="chosen", reported="2x"), "setting the lab chose; a speaker's figure"),
])
def test_record_refuses_what_could_mislead_the_report(kwargs, message):
    args = dict(lab=2, name="x", value=1.0) | kwargs
    with pytest.raises(ValueError, match=message):
        results.record(args.pop("lab"), args.pop("name"), args.pop("value"), **args)


def test_a_bad_profile_stops_labkit_run_before_any_lab(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LABKIT_PROFILE", "bogus")
    assert cli.main(["run", "3", "--out", str(tmp_path)]) == 2
    assert "profile must be one of ('ci', 'gpu', 'multi-gpu'), got 'bogus'" in capsys.readouterr().err
    assert not (tmp_path / "03_memory_movement").exists()


@pytest.mark.slow
def test_kernels_listen_on_no_tcp_port_and_forked_children_still_print(tmp_path):
    """ipykernel binds its pipe for forked children's output to TCP whatever the transport; labkit's kernel does not."""
    import shutil

    import nbformat

    from labkit.course.runner import _execute, _ProgressClient

    cells = ["import os, subprocess, multiprocessing as mp",
             "p = mp.get_context('fork').Process(target=print, args=('from a forked child',)); p.start(); p.join()",
             "out = subprocess.run(f\"ss -tlnp | grep 'pid={os.getpid()},'\", shell=True, capture_output=True, "
             "text=True).stdout\nassert out == '', out"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = _ProgressClient(nb, bar=None, timeout=60, kernel_name="python3",
                             resources={"metadata": {"path": str(tmp_path)}})
    try:
        client.bar = type("Bar", (), {"update": lambda self, n: None})()
        assert _execute(client) == ""
        assert client.kernel_dir is not None and client.kernel_dir.name.startswith("labkit-kernel-")
        assert "from a forked child" in "".join(o.get("text", "") for o in nb.cells[1].outputs)
        assert not list(tmp_path.iterdir()), "no socket lands in the notebook's folder"
    finally:
        shutil.rmtree(client.kernel_dir, ignore_errors=True)


def test_a_kernel_that_started_a_fork_server_exits_when_asked_instead_of_being_killed(tmp_path):
    """ipykernel stops its children at shutdown; the resource tracker ignores SIGTERM and a stopped fork server
    stays a zombie, so the kernel kept waiting until jupyter_client sent it SIGTERM (labkit/course/kernel.py)."""
    import shutil

    import nbformat

    from labkit.course.runner import _execute, _ProgressClient

    managers = []

    class Client(_ProgressClient):
        def create_kernel_manager(self):
            managers.append(super().create_kernel_manager())
            return managers[-1]

    cell = "import multiprocessing as mp\np = mp.get_context('forkserver').Process(target=int); p.start(); p.join()"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)])
    client = Client(nb, bar=type("Bar", (), {"update": lambda self, n: None})(), timeout=60, kernel_name="python3",
                    resources={"metadata": {"path": str(tmp_path)}})
    try:
        assert _execute(client) == ""
        # jupyter_client's record of how the kernel ended: asked, or SIGTERM/SIGKILL (KERNEL_EXIT_WAIT_S)
        assert managers[0]._shutdown_status.name == "ShutdownRequest", managers[0]._shutdown_status
    finally:
        shutil.rmtree(client.kernel_dir, ignore_errors=True)


def test_out_dir_is_made_absolute_because_kernels_run_in_notebooks(tmp_path, monkeypatch):
    from pathlib import Path

    monkeypatch.chdir(tmp_path)
    assert check_out_dir(Path("runs/x")) == tmp_path / "runs" / "x"


def test_shell_waits_are_sliced_so_a_missed_wakeup_costs_one_slice(monkeypatch):
    """nbclient waits on the shell socket without a timeout; a missed edge then hangs the run (nbclient#312)."""
    import asyncio
    import queue

    from labkit.course import runner

    monkeypatch.setattr(runner, "SHELL_POLL_SLICE_S", 0.01)
    waits = []

    async def get_msg(timeout=None):
        waits.append(timeout)
        if len(waits) < 4:
            raise queue.Empty
        return {"msg": "reply"}

    assert asyncio.run(runner._in_slices(get_msg)(timeout=None)) == {"msg": "reply"}
    assert waits == [0.01] * 4

    async def never(timeout=None):
        await asyncio.sleep(timeout)
        raise queue.Empty

    with pytest.raises(queue.Empty):
        asyncio.run(runner._in_slices(never)(timeout=0.05))


def test_a_teacher_merges_learners_reports_into_one_table_and_plot(tmp_path):
    paths = []
    for learner, busy, passed in (("ana", 0.31, True), ("ben", 0.82, False)):
        figures = [results.Figure(1, "busy fraction, file path", busy, ""),
                   results.Figure(1, "goodput", busy / 2, "", "modelled", basis="a model")]
        runs = [LabRun(LABS[0], passed, 40.0, figures=figures), LabRun(LABS[1], True, 50.0)]
        folder = tmp_path / learner
        folder.mkdir()
        write_report(runs, folder, learner=learner)
        paths.append(folder / "report.json")
    assert cli.main(["merge", *map(str, paths), "--out", str(tmp_path / "class")]) == 0
    table = (tmp_path / "class" / "class.md").read_text()
    assert "| Lab 1: busy fraction, file path | Lab 1: goodput [modelled] |" in table
    assert "| ana |" in table and "| 2 of 2 | 0.31 | 0.155 |" in table and "| 1 of 2 | 0.82 | 0.41 |" in table
    assert (tmp_path / "class" / "class.png").stat().st_size > 1000


def test_merge_refuses_what_is_not_a_report_and_a_learner_twice(tmp_path, capsys):
    from labkit.course import classroom

    stray = tmp_path / "notes.json"
    stray.write_text('{"a": 1}')
    assert cli.main(["merge", str(stray), "--out", str(tmp_path / "class")]) == 2
    assert "notes.json: not a labkit report" in capsys.readouterr().err
    write_report([LabRun(LABS[0], True, 1.0)], tmp_path, learner="ana")
    with pytest.raises(ValueError, match=r"learner\(s\) \['ana'\] appear in more than one report"):
        classroom.merge([tmp_path / "report.json"] * 2)
    with pytest.raises(ValueError, match="learner must name"):
        classroom.report_json(" ", {}, [])


def test_prepare_generates_each_labs_images_before_the_workshop(data_root, monkeypatch, capsys):
    from dataclasses import replace

    from labkit import dataengine, dsops, ladder

    monkeypatch.setattr(ladder, "SIZES", {name: replace(s, num_images=40) for name, s in ladder.SIZES.items()})
    monkeypatch.setattr(dataengine, "SIZES", {name: replace(s, num_images=30) for name, s in dataengine.SIZES.items()})
    monkeypatch.setattr(dsops, "ensure_built", lambda ops: {op: 0.0 for op in ops})
    assert cli.main(["prepare", "--profile", "ci", "--ops", "CPUAdamBuilder"]) == 0
    out = capsys.readouterr().out
    assert "Lab 1: 40 images" in out and "Lab 2: 30 images" in out and "CPUAdamBuilder: ready" in out
    assert len(list(data_root.glob("*/**/*.jpg"))) == 40 + 30


def test_a_labs_figures_are_this_runs_only(tmp_path):
    import base64

    import nbformat

    from labkit.course.runner import _save_images

    (tmp_path / "figure-12-0.png").write_bytes(b"a figure from a run whose cells sat elsewhere")
    nb = nbformat.v4.new_notebook()
    png = base64.b64encode(b"\x89PNG this run").decode()
    nb.cells = [nbformat.v4.new_code_cell(outputs=[nbformat.v4.new_output("display_data", data={"image/png": png})])]
    saved = _save_images(nb, tmp_path)
    assert [p.name for p in saved] == ["figure-00-0.png"]
    assert sorted(p.name for p in tmp_path.glob("figure-*.png")) == ["figure-00-0.png"]
