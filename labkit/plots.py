"""One plotting style for every lab.

Learners compare figures across labs, so colours mean the same thing throughout:
the baseline is grey, the fix is the accent colour, emulations are hatched.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

BASELINE = "#8c8c8c"
FIX = "#1f77b4"
WARN = "#d62728"
GOOD = "#2ca02c"
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"]

STYLE = {
    "figure.figsize": (7.5, 3.8),
    "figure.dpi": 100,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "legend.fontsize": 9,
    "axes.prop_cycle": plt.cycler(color=PALETTE),
}


def apply_style() -> None:
    plt.rcParams.update(STYLE)


def figure(ncols: int = 1, *, width: float = 7.5, height: float = 3.8) -> tuple[Figure, list[Axes]]:
    """A styled figure with ``ncols`` side-by-side axes (always returned as a list)."""
    apply_style()
    fig, axes = plt.subplots(1, ncols, figsize=(width, height), squeeze=False)
    return fig, list(axes[0])


def bars(
    ax: Axes,
    labels: Sequence[str],
    values: Sequence[float],
    *,
    colors: Sequence[str] | None = None,
    fmt: str = "{:.2f}",
    ylabel: str = "",
    title: str = "",
) -> None:
    """Labelled bars with their values printed on top."""
    drawn = ax.bar(range(len(values)), values, color=colors or PALETTE[0])
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right")
    ax.bar_label(drawn, labels=[fmt.format(v) for v in values], fontsize=8, padding=2)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.margins(y=0.15)


def grouped_bars(
    ax: Axes,
    groups: Sequence[str],
    series: Mapping[str, Sequence[float]],
    *,
    colors: Sequence[str] | None = None,
    fmt: str = "{:.2f}",
    ylabel: str = "",
    title: str = "",
) -> None:
    """Side-by-side labelled bars: one group per x position, one bar per series in each."""
    width = 0.8 / len(series)
    for index, (name, values) in enumerate(series.items()):
        if len(values) != len(groups):
            raise ValueError(f"series {name!r} has {len(values)} values for {len(groups)} groups")
        xs = [x + (index - (len(series) - 1) / 2) * width for x in range(len(groups))]
        color = (colors or PALETTE)[index % len(colors or PALETTE)]
        drawn = ax.bar(xs, values, width, label=name, color=color)
        ax.bar_label(drawn, labels=[fmt.format(v) for v in values], fontsize=8, padding=2)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    ax.margins(y=0.15)


def timeline(
    ax: Axes,
    spans: Sequence[tuple[str, float, float, str]],
    *,
    title: str = "",
    xlabel: str = "time (ms)",
) -> None:
    """Gantt-style rows: each span is (row label, start, duration, colour)."""
    rows = list(dict.fromkeys(label for label, *_ in spans))
    for label, start, duration, color in spans:
        ax.broken_barh([(start, duration)], (rows.index(label) - 0.4, 0.8), facecolors=color)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.invert_yaxis()
