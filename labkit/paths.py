"""Where generated data lives.

Everything labkit makes (datasets, caches, checkpoints, logs) lands under one
data directory so that a learner can delete it in one go and CI can point it at a
scratch folder. ``$LABKIT_DATA`` overrides the default ``<repo>/data``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from labkit.processes import remove_folders_of_ended

ENV_VAR = "LABKIT_DATA"
RUN_PREFIX = "run-"


def repo_root() -> Path | None:
    """The checkout labkit was imported from, if it is one (editable install)."""
    candidate = Path(__file__).resolve().parent.parent
    return candidate if (candidate / "pyproject.toml").exists() else None


def data_dir() -> Path:
    """The data directory, created on first use."""
    if os.environ.get(ENV_VAR):
        path = Path(os.environ[ENV_VAR])
    elif repo_root() is not None:
        path = repo_root() / "data"
    else:
        path = Path.cwd() / "data"
    path.mkdir(parents=True, exist_ok=True)
    return path.resolve()


def run_dir(name: str) -> Path:
    """A lab's scratch folder for this process: ``data_dir()/name/run-<pid>``, empty.

    A lab's checkpoints and stores start afresh on every run. Started afresh in one shared folder, two
    copies of a lab at once (a notebook open while ``labkit run`` runs the same lab, two tests) removed each
    other's files: a Lab 7 test once read a checkpoint another had just removed. Named for the process,
    each run starts afresh in its own, kept after the run for a look, and removed by the next run once its
    process has ended.
    """
    parent = data_dir() / name
    parent.mkdir(exist_ok=True)
    remove_folders_of_ended(parent, RUN_PREFIX)
    folder = parent / f"{RUN_PREFIX}{os.getpid()}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    return folder
