"""A workshop's reports in one table: which learner's machine has which bottleneck.

``labkit run`` writes ``report.json`` beside its report: the learner, the
machine, and each lab's result, time and key measured figures. A teacher
collects those files and runs ``labkit merge`` over them. The table puts every
learner in a row and every figure in a column; the plot gives each figure a
panel with a bar per learner, so the machine whose accelerator starved (Lab 1's
busy fraction) or whose link dominated (Lab 5) stands out at a glance.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

FORMAT = "labkit-report/1"


@dataclass(frozen=True)
class LearnerReport:
    learner: str
    machine: str
    labs_passed: int
    labs_run: int
    figures: dict[str, float]
    """``"Lab N: figure name (unit)"`` -> value."""


def report_json(learner: str, machine: dict, labs: list[dict]) -> str:
    """The machine-readable report ``labkit run`` writes (``labs``: number, slug, passed, seconds, figures)."""
    if not learner.strip():
        raise ValueError("learner must name the learner or machine, got an empty string")
    return json.dumps({"format": FORMAT, "learner": learner, "machine": machine, "labs": labs}, indent=1)


def read_report(path: str | Path) -> LearnerReport:
    """One learner's ``report.json``; a file that is not one is refused with its name."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a readable labkit report ({error}); pass the report.json "
                         "that `labkit run` wrote") from error
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a labkit report (expected format {FORMAT!r}); pass the report.json "
                         "that `labkit run` wrote")
    figures = {_column(lab["number"], f): f["value"] for lab in data["labs"] for f in lab["figures"]}
    machine = ", ".join(f"{k} {v}" for k, v in data["machine"].items() if k != "load_avg")
    return LearnerReport(data["learner"], machine, sum(lab["passed"] for lab in data["labs"]),
                         len(data["labs"]), figures)


def _column(lab: int, figure: dict) -> str:
    """A figure's column name; modelled figures and settings say so, so no one reads them as measured."""
    kind = figure.get("kind", "measured")
    unit = f" ({figure['unit']})" if figure["unit"] else ""
    return f"Lab {lab}: {figure['name']}{unit}" + ("" if kind == "measured" else f" [{kind}]")


def merge(paths: list[str | Path]) -> list[LearnerReport]:
    """Every learner's report, in the order given; two reports of one learner are refused."""
    if not paths:
        raise ValueError("give at least one report.json")
    reports = [read_report(path) for path in paths]
    names = [report.learner for report in reports]
    if duplicated := sorted({name for name in names if names.count(name) > 1}):
        raise ValueError(f"learner(s) {duplicated} appear in more than one report; "
                         "run each machine with its own `labkit run --learner NAME`")
    return reports


def columns(reports: list[LearnerReport]) -> list[str]:
    """Every figure any learner measured, in lab order."""
    seen = {name: None for report in reports for name in report.figures}
    return sorted(seen, key=lambda name: int(name.split(":")[0].split()[1]))


def markdown_table(reports: list[LearnerReport]) -> str:
    names = columns(reports)
    lines = ["| learner | machine | labs passed | " + " | ".join(names) + " |",
             "|" + " --- |" * (3 + len(names))]
    for report in reports:
        values = [_cell(report.figures.get(name)) for name in names]
        lines.append(f"| {report.learner} | {report.machine} | {report.labs_passed} of {report.labs_run} | "
                     + " | ".join(values) + " |")
    return "\n".join(lines) + "\n"


def _cell(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.3g}"


def plot(reports: list[LearnerReport], path: str | Path) -> Path:
    """One panel per figure, one bar per learner; a learner who did not run that lab has no bar."""
    import matplotlib.pyplot as plt

    from labkit import plots

    names = columns(reports)
    if not names:
        raise ValueError("the reports hold no measured figures: run at least one lab with `labkit run`")
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.6 * rows), squeeze=False)
    learners = [report.learner for report in reports]
    for ax, name in zip(axes.flat, names):
        values = [report.figures.get(name, math.nan) for report in reports]
        plots.bars(ax, learners, values, fmt="{:.3g}", title=name)
        ax.title.set_fontsize(8)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
