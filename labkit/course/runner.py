"""Execute the lab notebooks headlessly and write the course report.

Each lab runs in its own kernel (nbclient), so a failing lab does not stop the
others; its executed notebook, its figures (PNG) and its key measured figures are
kept under ``--out``, and ``report.md`` / ``report.html`` put them on one page.

SIGINT and SIGTERM stop the whole run: the kernel's process group is killed
(its ranks die with it, see :func:`labkit.processes.die_with_parent`), the report
covers the labs that finished, and the command exits 128 + the signal number.
nbclient runs in a worker thread so that these signals reach the runner itself:
in the main thread nbclient installs its own handlers, which kill the current
kernel and then go on to the next lab.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import html
import os
import queue
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from tqdm.auto import tqdm

from labkit import profiles
from labkit.course import classroom, results
from labkit.course import Lab, notebooks_dir
from labkit.devices import describe_machine
from labkit.processes import kill_group

SHELL_POLL_SLICE_S = 1.0
"""Longest single wait on the kernel's shell socket before its state is checked afresh."""


class RunStopped(Exception):
    """SIGTERM or SIGINT reached ``labkit run``; carries the signal number."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


@dataclass
class LabRun:
    lab: Lab
    passed: bool
    seconds: float
    error: str = ""
    figures: list[results.Figure] = field(default_factory=list)
    images: list[Path] = field(default_factory=list)


def check_out_dir(out: Path) -> Path:
    """Fail early, naming the folder, if results could not be written there.

    Returns the absolute path: each notebook's kernel runs in ``notebooks/``, so a
    relative path would point somewhere else from inside a lab.
    """
    out = out.resolve()
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"--out {out} is not a writable folder ({exc.strerror}); choose another with --out") from exc
    return out


def _in_slices(get_msg):
    """Wrap a kernel channel's async ``get_msg`` so that no single wait exceeds a slice.

    pyzmq's asyncio poll waits for an edge on the socket's file descriptor; a
    send on the same socket while the wait is pending can consume that edge, and
    an unbounded wait then never returns (jupyter/nbclient#312). A wait that ends
    by timeout re-checks the socket's level state, so slicing bounds a missed
    edge to one slice.
    """

    async def get_msg_in_slices(timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                return await get_msg(timeout=SHELL_POLL_SLICE_S if remaining is None
                                     else min(SHELL_POLL_SLICE_S, remaining))
            except queue.Empty:
                if remaining is not None and remaining <= SHELL_POLL_SLICE_S:
                    raise

    return get_msg_in_slices


KERNEL_EXIT_WAIT_S = 30.0
"""How long jupyter_client waits for an asked kernel to exit: half of it before SIGTERM, half before SIGKILL.

A kernel asked to shut down first stops its children (ipykernel SIGTERMs them, checking again after 0.01,
0.03, 0.1, 0.3, 1, 3 and 10 s, 14.4 s in all before it SIGKILLs them), then runs its exit hooks, which remove
what the lab made. A kernel that had started a fork server exited 0.5-1.0 s after the request in 56 of 57
one-cell runs here: idle, beside six spinning processes, beside a disk kept busy with fsyncs, and three at
once; and in 30 of 30 beside one spinning process (2.3-2.7 s a run, start to end). Three times it took
longer than the patience then given and was SIGTERMed mid-shutdown: once in a fresh process on an idle
machine (3.5 s, against jupyter_client's default 2.5 s), twice in the test suite's first part
(``tests/test_runner.py``; the second time beside Lab 8's recovery tests, against 6 s). The cause was not
caught, and a child slow to die keeps ipykernel asleep for its next check, up to 10 s. So the wait before
SIGTERM covers ipykernel's whole sequence; a kernel that exits at once loses nothing to it."""


class _ProgressClient(NotebookClient):
    """An nbclient that advances a tqdm bar per cell, knows its cell and its kernel's pid."""

    def __init__(self, nb, bar: tqdm, **kwargs):
        super().__init__(nb, **kwargs)
        self.bar = bar
        self.cell_index: int | None = None

    def create_kernel_manager(self):
        """A kernel on Unix sockets where the platform has them: no TCP port any local user could reach.

        The sockets and the connection file live in :func:`kernel_folder`, by absolute path: the kernel starts
        in ``notebooks/`` and the runner elsewhere, so a relative one would name two places. The kernel is
        :mod:`labkit.course.kernel`, which moves ipykernel's last TCP port (its pipe for forked children's
        output) onto a Unix socket too.
        """
        km = super().create_kernel_manager()
        if os.name == "posix":
            from jupyter_client.kernelspec import KernelSpec

            self.kernel_dir = kernel_folder()
            km.transport = "ipc"
            km.ip = str(self.kernel_dir / "kernel")
            km.connection_file = str(self.kernel_dir / "kernel.json")
            km._kernel_spec = KernelSpec(argv=[sys.executable, "-m", "labkit.course.kernel", "-f",
                                               "{connection_file}"], display_name="labkit", language="python")
        km.shutdown_wait_time = KERNEL_EXIT_WAIT_S
        return km

    async def async_start_new_kernel_client(self):
        kc = await super().async_start_new_kernel_client()
        kc.shell_channel.get_msg = _in_slices(kc.shell_channel.get_msg)
        return kc

    async def async_execute_cell(self, cell, cell_index, **kwargs):
        self.cell_index = cell_index
        try:
            return await super().async_execute_cell(cell, cell_index, **kwargs)
        finally:
            self.bar.update(1)

    kernel_dir: Path | None = None

    def kernel_pid(self) -> int | None:
        process = getattr(getattr(self.km, "provisioner", None), "process", None)
        return getattr(process, "pid", None)


def _execute(client: _ProgressClient) -> str:
    """Run every cell; the error text for the report, or "" when every cell passed."""
    try:
        client.execute()
        return ""
    except CellExecutionError as exc:
        return f"cell {client.cell_index}: " + _short_error(str(exc))
    except Exception as exc:  # noqa: BLE001 - the report shows any failure instead of crashing
        where = f"cell {client.cell_index}: " if client.cell_index is not None else ""
        return f"{where}{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"


def _execute_stoppably(client: _ProgressClient) -> str:
    """:func:`_execute` in a worker thread; on a signal, kill the kernel's group and re-raise."""
    outcome: list[str] = []
    worker = threading.Thread(target=lambda: outcome.append(_execute(client)), name="labkit-nbclient", daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.2)
    except BaseException:
        kernel_pid = client.kernel_pid()
        _say(f"stopping: kernel {kernel_pid} gets {KERNEL_GRACE_S:g} s to unwind, then SIGKILL")
        kill_group(kernel_pid, grace_s=KERNEL_GRACE_S)
        worker.join(NBCLIENT_GRACE_S)
        _say("stopping: kernel gone" + ("" if not worker.is_alive() else
                                        f"; nbclient still waiting after {NBCLIENT_GRACE_S:g} s, left behind"))
        _forget_kernel(client)
        raise
    return outcome[0]


def kernel_folder() -> Path:
    """A private folder for a kernel's sockets, ``labkit-kernel-<pid>-*`` so a sweep finds it once the runner is gone.

    It sits where a Unix socket's path stays short enough (see :func:`labkit.processes.multiprocessing_base_dir`).
    """
    import tempfile

    from labkit.launcher import KERNEL_DIR_PREFIX
    from labkit.processes import multiprocessing_base_dir

    return Path(tempfile.mkdtemp(prefix=f"{KERNEL_DIR_PREFIX}{os.getpid()}-", dir=multiprocessing_base_dir()))


def _forget_kernel(client: _ProgressClient) -> None:
    """Remove what a killed kernel left: its connection file and nbclient's exit hook.

    Its ranks' log folders and fork-server folder carry the dead kernel's pid, so
    :func:`run_lab`'s sweep takes them (namespaces of a fabric it had open are
    its reaper's job, :func:`labkit.netns.start_reaper`). nbclient unregisters its
    exit hook only when its cleanup completes. After a stop it may not have, and
    the hook then runs at interpreter exit, where destroying the kernel's zmq
    context can block forever on sockets the abandoned thread still holds (seen
    in the test suite: ``labkit run`` never exited after SIGTERM).
    """
    atexit.unregister(client._cleanup_kernel)
    if client.km is not None:
        client.km.cleanup_connection_file()


KERNEL_GRACE_S = 10.0
"""How long a stopped kernel gets to unwind after SIGTERM (a fabric tears down its namespaces then)."""
NBCLIENT_GRACE_S = 5.0
"""How long nbclient's thread gets to notice its kernel died (it polls every second); it is a daemon after that."""


def _say(line: str) -> None:
    tqdm.write(f"labkit run: {line}", file=sys.stderr)


def run_lab(lab: Lab, out: Path, *, profile: str | None, timeout_s: int = 900) -> LabRun:
    source = notebooks_dir() / lab.notebook
    nb = nbformat.read(source, as_version=4)
    lab_dir = out / f"{lab.number:02d}_{lab.slug}"
    lab_dir.mkdir(parents=True, exist_ok=True)
    figures_path = lab_dir / "figures.jsonl"
    figures_path.unlink(missing_ok=True)
    env_before = dict(os.environ)
    os.environ[results.ENV_VAR] = str(figures_path)
    # Figures must land in the executed notebook (and so in the report) even where the caller set a file-only
    # backend such as Agg for its own plots: that is what a headless run is for.
    os.environ["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    if profile:
        os.environ["LABKIT_PROFILE"] = profile
    start = time.perf_counter()
    with tqdm(total=len(nb.cells), desc=f"lab {lab.number} {lab.slug}", unit="cell") as bar:
        client = _ProgressClient(nb, bar, timeout=timeout_s, kernel_name="python3",
                                 resources={"metadata": {"path": str(source.parent)}})
        try:
            error = _execute_stoppably(client)
        finally:
            os.environ.clear()
            os.environ.update(env_before)
            nbformat.write(nb, lab_dir / lab.notebook)  # a stopped run keeps the cells it ran
            # The kernel is gone: sweep what it could not remove, in case it was killed before its exit hooks
            # ran (see KERNEL_EXIT_WAIT_S and labkit/course/kernel.py).
            from labkit.launcher import remove_stale_dirs

            remove_stale_dirs()
            if client.kernel_dir is not None:
                shutil.rmtree(client.kernel_dir, ignore_errors=True)
    seconds = time.perf_counter() - start
    return LabRun(lab, passed=not error, seconds=seconds, error=error,
                  figures=results.read(figures_path), images=_save_images(nb, lab_dir))


def _short_error(text: str, lines: int = 12) -> str:
    kept = [line for line in text.splitlines() if line.strip()]
    return "\n".join(kept[-lines:])


def _save_images(nb, lab_dir: Path) -> list[Path]:
    """This run's figures; a previous run's in the same folder go, as cells may have moved since."""
    for old in lab_dir.glob("figure-*.png"):
        old.unlink()
    saved = []
    for index, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if "image/png" in data:
                path = lab_dir / f"figure-{index:02d}-{len(saved)}.png"
                path.write_bytes(base64.b64decode(data["image/png"]))
                saved.append(path)
    return saved


def run_labs(labs: list[Lab], out: Path, *, profile: str | None = None, learner: str | None = None) -> list[LabRun]:
    """Run ``labs`` in order; on SIGTERM or SIGINT stop, report what finished, raise :class:`RunStopped`."""
    out = check_out_dir(out)
    try:
        profiles.profile(profile)  # a bad LABKIT_PROFILE stops here, named, instead of failing every lab
    except RuntimeError as exc:
        raise ValueError(str(exc)) from exc
    runs: list[LabRun] = []
    try:
        with stopped_by_signals():
            for lab in labs:
                runs.append(run_lab(lab, out, profile=profile))
    finally:
        write_report(runs, out, learner=learner)
    return runs


@contextlib.contextmanager
def stopped_by_signals() -> Iterator[None]:
    """Inside, SIGTERM and SIGINT raise :class:`RunStopped`, so :func:`run_lab` stops its kernel cleanly."""
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in previous:
        signal.signal(sig, _raise_stop)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _raise_stop(signum: int, _frame: object) -> None:
    raise RunStopped(signum)


def write_report(runs: list[LabRun], out: Path, *, learner: str | None = None) -> tuple[Path, Path]:
    """report.md and report.html for a reader; report.json for a teacher's ``labkit merge``.

    Measured, modelled and chosen figures sit in columns of their own, and a
    speaker's figure stands beside ours only when :func:`results.record` was told
    it is the same quantity; other speaker figures are footnotes (context).
    """
    machine = describe_machine()
    labs = [{"number": run.lab.number, "slug": run.lab.slug, "passed": run.passed, "seconds": round(run.seconds, 1),
             "figures": [{"name": f.name, "value": f.value, "unit": f.unit, "kind": f.kind} for f in run.figures]}
            for run in runs]
    (out / "report.json").write_text(classroom.report_json(learner or socket.gethostname(), machine, labs))
    lines = ["# labkit course report", "",
             "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()), "",
             "| lab | result | time | " + " | ".join(title for _, title in COLUMNS) + " |",
             "| --- | --- | --- |" + " --- |" * len(COLUMNS)]
    for run in runs:
        cells = [_joined(run, column, "; ") for column, _ in COLUMNS]
        status = "passed" if run.passed else "**FAILED**"
        lines.append(f"| {run.lab.number} {run.lab.slug} | {status} | {run.seconds:.0f} s | " + " | ".join(cells) + " |")
    lines += _notes(runs)
    failures = [run for run in runs if not run.passed]
    for run in failures:
        lines += ["", f"## Lab {run.lab.number} failed", "", "```", run.error, "```"]
    lines += ["", f"{sum(r.passed for r in runs)} of {len(runs)} labs passed every assert."]
    md_path = out / "report.md"
    md_path.write_text("\n".join(lines) + "\n")
    html_path = out / "report.html"
    html_path.write_text(_html(runs, machine))
    return md_path, html_path


COLUMNS = (("measured", "measured here"),
           ("modelled", "modelled here, from measured inputs"),
           ("setting", "set by the lab"),
           ("reported", "the speaker's figure of the same quantity"))


def _joined(run: LabRun, column: str, sep: str) -> str:
    if column == "reported":
        texts = [f"{f.name}: {f.reported}" for f in run.figures if f.reported]
    else:
        texts = [f.as_text() for f in run.figures if f.kind == column]
    return sep.join(texts) or "-"


def _notes(runs: list[LabRun]) -> list[str]:
    """How figures were obtained (every modelled or chosen one says), and speakers' figures of other quantities."""
    basis = [f"- Lab {f.lab}, {f.name} ({f.kind}): {f.basis}" for run in runs for f in run.figures if f.basis]
    context = [f"- Lab {f.lab}: {f.context}" for run in runs for f in run.figures if f.context]
    lines = []
    if basis:
        lines += ["", "How figures were obtained, where the lab says (every modelled and chosen one does):", "", *basis]
    if context:
        lines += ["", "For context, what the speakers reported for *other* quantities (not comparable with a "
                  "figure above):", "", *context]
    return lines


def _html(runs: list[LabRun], machine: dict) -> str:
    rows = []
    for run in runs:
        cells = "".join(f"<td>{html.escape(_joined(run, column, chr(10))).replace(chr(10), '<br>')}</td>"
                        for column, _ in COLUMNS)
        status = "passed" if run.passed else f"<b>FAILED</b><pre>{html.escape(run.error)}</pre>"
        thumbs = "".join(f'<img src="{p.parent.name}/{p.name}" width="260">' for p in run.images[:3])
        rows.append(f"<tr><td>{run.lab.number} {run.lab.slug}</td><td>{status}</td><td>{run.seconds:.0f} s</td>"
                    f"{cells}<td>{thumbs}</td></tr>")
    head = html.escape(", ".join(f"{k} {v}" for k, v in machine.items()))
    notes = "".join(f"<p>{html.escape(line)}</p>" for line in _notes(runs) if line)
    titles = "".join(f"<th>{html.escape(title)}</th>" for _, title in COLUMNS)
    return ("<!doctype html><meta charset='utf-8'><title>labkit report</title>"
            "<style>body{font-family:sans-serif;margin:2em}td,th{border:1px solid #ccc;padding:4px;"
            "vertical-align:top}table{border-collapse:collapse}</style>"
            f"<h1>labkit course report</h1><p>Machine: {head}</p><table><tr><th>lab</th><th>result</th>"
            f"<th>time</th>{titles}<th>figures</th></tr>"
            + "".join(rows) + f"</table>{notes}<p>{sum(r.passed for r in runs)} of {len(runs)} labs passed.</p>")
