"""Key figures a lab measured, written where ``labkit run`` can collect them.

A notebook calls :func:`record` for the few numbers a reader should see in the
course report. Outside ``labkit run`` (no ``LABKIT_RESULTS`` set) it only
returns the figure, so notebooks run unchanged.

Every figure says what it *is*, because the report must not let a reader take a
choice or a model's output for a finding:

- ``measured``: timed, counted or read on this machine in this run;
- ``modelled``: computed by a model from inputs measured in this run
  (``basis`` names the model and its inputs);
- ``setting``: a condition the lab chose (a link rate, a sizing ratio), with
  ``basis`` saying why.

A speaker's figure goes in ``reported`` only when it is the *same quantity in
the same unit* (and, where the quantity depends on scale, at a stated scale):
the report sets the two side by side. Anything else a speaker said that helps
the reader, but is another quantity, goes in ``context`` and the report prints
it as a footnote, never in the comparison column.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

ENV_VAR = "LABKIT_RESULTS"
KINDS = ("measured", "modelled", "setting")


@dataclass(frozen=True)
class Figure:
    lab: int
    name: str
    value: float
    unit: str
    kind: str = "measured"
    basis: str = ""
    reported: str = ""
    context: str = ""

    def as_text(self) -> str:
        return f"{self.name}: {self.value:.3g} {self.unit}".strip()


def record(lab: int, name: str, value: float, unit: str = "", *, kind: str = "measured", basis: str = "",
           reported: str = "", context: str = "") -> Figure:
    """Keep one figure of this run for the course report; see the module docstring for ``kind``."""
    if not 1 <= lab <= 8:
        raise ValueError(f"lab must be in 1..8, got {lab}")
    if not math.isfinite(float(value)):
        raise ValueError(f"value of {name!r} must be finite, got {value}")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if kind != "measured" and not basis.strip():
        raise ValueError(f"a {kind} figure ({name!r}) needs basis=: "
                         + ("the model and the measured inputs it used" if kind == "modelled"
                            else "why the lab chose this value"))
    if kind == "setting" and reported:
        raise ValueError(f"{name!r} is a setting the lab chose; a speaker's figure can only stand beside a "
                         "measured or modelled one (put it in context=)")
    figure = Figure(lab, name, float(value), unit, kind, basis, reported, context)
    target = os.environ.get(ENV_VAR)
    if target:
        with open(Path(target), "a") as handle:
            handle.write(json.dumps(asdict(figure)) + "\n")
    return figure


def read(path: str | Path) -> list[Figure]:
    path = Path(path)
    if not path.exists():
        return []
    return [Figure(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
