"""Where generated data lives.

Everything labkit makes (datasets, caches, checkpoints, logs) lands under one
data directory so that a learner can delete it in one go and CI can point it at a
scratch folder. ``$LABKIT_DATA`` overrides the default ``<repo>/data``.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "LABKIT_DATA"


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
