"""Notebooks are committed without outputs, and each lab in the course map has one."""

import json
import re
from pathlib import Path

import pytest

from labkit.course import LABS, notebooks_dir

NOTEBOOKS = sorted(notebooks_dir().glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_without_outputs(path: Path):
    nb = json.loads(path.read_text())
    dirty = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code" and (c.get("outputs") or c.get("execution_count"))]
    assert not dirty, f"{path.name}: cells {dirty} carry outputs; clear them (jupyter nbconvert --clear-output --inplace)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_first_cell_names_the_labkit_modules(path: Path):
    first = json.loads(path.read_text())["cells"][0]
    assert first["cell_type"] == "markdown" and re.search(r"labkit[./]\w+", "".join(first["source"]))


def test_every_notebook_belongs_to_a_lab_of_the_course_map():
    names = {lab.notebook for lab in LABS}
    assert {p.name for p in NOTEBOOKS} <= names


PROCESS_WORDS = re.compile(r"\b[Tt]he issue\b|\bissue's\b|\b[Ss]abotag\w*|\b[Rr]ehears\w*|\bCI\b|\b[Tt]est suite\b"
                           r"|\bnbval\b|\b[Ff]lak(?:y|iness)\b|\b[Aa] test (?:keeps|checks|fails)\b")
"""Words of how the course is built and tested. A learner reads the markdown; our process is not the lesson."""


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_markdown_speaks_of_the_lesson_not_of_our_process(path: Path):
    cells = json.loads(path.read_text())["cells"]
    found = {(i, m.group(0)) for i, c in enumerate(cells) if c["cell_type"] == "markdown"
             for m in PROCESS_WORDS.finditer("".join(c["source"]))}
    assert not found, f"{path.name}: markdown cells speak of our own process: {sorted(found)}"
