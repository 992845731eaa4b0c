"""Execute the lab notebooks headlessly and write the course report.

Each lab runs in its own kernel (nbclient), so a failing lab does not stop the
others; its executed notebook, its figures (PNG) and its key measured figures are
kept under ``--out``, and ``report.md`` / ``report.html`` put them on one page.
"""

from __future__ import annotations

import base64
import html
import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from tqdm.auto import tqdm

from labkit import results
from labkit.course import Lab, notebooks_dir
from labkit.devices import describe_machine


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


class _ProgressClient(NotebookClient):
    """An nbclient that advances a tqdm bar per cell."""

    def __init__(self, nb, bar: tqdm, **kwargs):
        super().__init__(nb, **kwargs)
        self.bar = bar

    async def async_execute_cell(self, cell, cell_index, **kwargs):
        try:
            return await super().async_execute_cell(cell, cell_index, **kwargs)
        finally:
            self.bar.update(1)


def run_lab(lab: Lab, out: Path, *, profile: str | None, timeout_s: int = 900) -> LabRun:
    source = notebooks_dir() / lab.notebook
    nb = nbformat.read(source, as_version=4)
    lab_dir = out / f"{lab.number:02d}_{lab.slug}"
    lab_dir.mkdir(parents=True, exist_ok=True)
    figures_path = lab_dir / "figures.jsonl"
    figures_path.unlink(missing_ok=True)
    env_before = dict(os.environ)
    os.environ[results.ENV_VAR] = str(figures_path)
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    if profile:
        os.environ["LABKIT_PROFILE"] = profile
    start = time.perf_counter()
    error = ""
    with tqdm(total=len(nb.cells), desc=f"lab {lab.number} {lab.slug}", unit="cell") as bar:
        client = _ProgressClient(nb, bar, timeout=timeout_s, kernel_name="python3",
                                 resources={"metadata": {"path": str(source.parent)}})
        try:
            client.execute()
        except CellExecutionError as exc:
            error = _short_error(str(exc))
        except Exception as exc:  # noqa: BLE001 - the report shows any failure instead of crashing
            error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
        finally:
            os.environ.clear()
            os.environ.update(env_before)
    seconds = time.perf_counter() - start
    nbformat.write(nb, lab_dir / lab.notebook)
    return LabRun(lab, passed=not error, seconds=seconds, error=error,
                  figures=results.read(figures_path), images=_save_images(nb, lab_dir))


def _short_error(text: str, lines: int = 12) -> str:
    kept = [line for line in text.splitlines() if line.strip()]
    return "\n".join(kept[-lines:])


def _save_images(nb, lab_dir: Path) -> list[Path]:
    saved = []
    for index, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if "image/png" in data:
                path = lab_dir / f"figure-{index:02d}-{len(saved)}.png"
                path.write_bytes(base64.b64decode(data["image/png"]))
                saved.append(path)
    return saved


def run_labs(labs: list[Lab], out: Path, *, profile: str | None = None) -> list[LabRun]:
    out = check_out_dir(out)
    runs = [run_lab(lab, out, profile=profile) for lab in labs]
    write_report(runs, out)
    return runs


def write_report(runs: list[LabRun], out: Path) -> tuple[Path, Path]:
    machine = describe_machine()
    lines = ["# labkit course report", "",
             "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()), "",
             "| lab | result | time | key measured figures (this machine) | reported by the speaker (their workload) |",
             "| --- | --- | --- | --- | --- |"]
    for run in runs:
        measured = "; ".join(f"{f.name}: {f.value:.3g} {f.unit}".strip() for f in run.figures) or "-"
        reported = "; ".join(f.reported for f in run.figures if f.reported) or "-"
        status = "passed" if run.passed else "**FAILED**"
        lines.append(f"| {run.lab.number} {run.lab.slug} | {status} | {run.seconds:.0f} s | {measured} | {reported} |")
    failures = [run for run in runs if not run.passed]
    for run in failures:
        lines += ["", f"## Lab {run.lab.number} failed", "", "```", run.error, "```"]
    lines += ["", f"{sum(r.passed for r in runs)} of {len(runs)} labs passed every assert."]
    md_path = out / "report.md"
    md_path.write_text("\n".join(lines) + "\n")
    html_path = out / "report.html"
    html_path.write_text(_html(runs, machine))
    return md_path, html_path


def _html(runs: list[LabRun], machine: dict) -> str:
    rows = []
    for run in runs:
        figures = "<br>".join(html.escape(f"{f.name}: {f.value:.3g} {f.unit}") for f in run.figures) or "-"
        reported = "<br>".join(html.escape(f.reported) for f in run.figures if f.reported) or "-"
        status = "passed" if run.passed else f"<b>FAILED</b><pre>{html.escape(run.error)}</pre>"
        thumbs = "".join(f'<img src="{p.parent.name}/{p.name}" width="260">' for p in run.images[:3])
        rows.append(f"<tr><td>{run.lab.number} {run.lab.slug}</td><td>{status}</td><td>{run.seconds:.0f} s</td>"
                    f"<td>{figures}</td><td>{reported}</td><td>{thumbs}</td></tr>")
    head = html.escape(", ".join(f"{k} {v}" for k, v in machine.items()))
    return ("<!doctype html><meta charset='utf-8'><title>labkit report</title>"
            "<style>body{font-family:sans-serif;margin:2em}td,th{border:1px solid #ccc;padding:4px;"
            "vertical-align:top}table{border-collapse:collapse}</style>"
            f"<h1>labkit course report</h1><p>Machine: {head}</p><table><tr><th>lab</th><th>result</th>"
            "<th>time</th><th>measured here</th><th>reported by the speaker</th><th>figures</th></tr>"
            + "".join(rows) + f"</table><p>{sum(r.passed for r in runs)} of {len(runs)} labs passed.</p>")
