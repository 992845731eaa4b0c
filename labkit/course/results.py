"""Key figures a lab measured, written where ``labkit run`` can collect them.

A notebook calls :func:`record` for the few numbers a reader should see in the
course report, beside what the speaker reported. Outside ``labkit run`` (no
``LABKIT_RESULTS`` set) it only returns the figure, so notebooks run unchanged.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

ENV_VAR = "LABKIT_RESULTS"


@dataclass(frozen=True)
class Figure:
    lab: int
    name: str
    value: float
    unit: str
    reported: str = ""


def record(lab: int, name: str, value: float, unit: str = "", *, reported: str = "") -> Figure:
    """Keep one measured figure (``reported`` is the speaker's comparable figure, quoted as theirs)."""
    if not 1 <= lab <= 8:
        raise ValueError(f"lab must be in 1..8, got {lab}")
    if not math.isfinite(float(value)):
        raise ValueError(f"value of {name!r} must be finite, got {value}")
    figure = Figure(lab, name, float(value), unit, reported)
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
