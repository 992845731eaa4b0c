"""Shared fixtures: every test writes generated data to a scratch folder."""

import pytest


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
