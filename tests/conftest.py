"""Shared fixtures: every test writes generated data to a scratch folder."""

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from labkit.launcher import LOG_DIR_PREFIX, remove_stale_dirs


@pytest.fixture(autouse=True)
def _no_rank_logs_left_behind():
    """A launch that fails keeps its ranks' logs for the reader of the error; in a test, pytest read it.

    Tests that make ranks fail on purpose would otherwise leave ``labkit-ranks-*``
    folders in the temp dir (three per suite run).
    """
    pattern = f"{LOG_DIR_PREFIX}{os.getpid()}-*"
    before = set(Path(tempfile.gettempdir()).glob(pattern))
    yield
    for folder in set(Path(tempfile.gettempdir()).glob(pattern)) - before:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True, scope="session")
def _no_fork_server_folders_left_behind():
    """Tests that kill a launching process on purpose leave its ``labkit-mp-<pid>-*`` folder; sweep them at the end."""
    yield
    remove_stale_dirs()


@pytest.fixture()
def data_root(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_DATA", str(tmp_path / "data"))
    return tmp_path / "data"


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory):
    """One small generated dataset shared by the tests that only read it."""
    import os

    from labkit import dataset

    root = tmp_path_factory.mktemp("shared-data")
    old = os.environ.get("LABKIT_DATA")
    os.environ["LABKIT_DATA"] = str(root)
    try:
        made = dataset.generate(120, progress=False)
    finally:
        if old is None:
            os.environ.pop("LABKIT_DATA", None)
        else:
            os.environ["LABKIT_DATA"] = old
    return made
