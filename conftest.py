"""The test suite runs every exercise with its reference answer (see labkit.exercises).

Tests marked ``alone`` time something on this machine against a model or an ordering, or read state
the whole machine shares (its network namespaces): they run by themselves, after the rest has run two
at a time (the README's test command). Every notebook is one of them: a lab's asserts compare what it
measured, so a lab runs with the machine to itself, as a learner's would.
"""

import os
from pathlib import Path

import nbval.kernel
import pytest

from tests.forked_kernels import ForkedSyncKernelManager, close_zygote

os.environ.setdefault("LABKIT_SOLUTIONS", "1")
# nbval's kernels are forks of a process that has imported torch already, as the sabotages' are
# (tests/forked_kernels.py): about a second less per notebook.
nbval.kernel.KernelManager = ForkedSyncKernelManager


def pytest_sessionfinish() -> None:
    close_zygote()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).suffix == ".ipynb":
            item.add_marker(pytest.mark.alone)
    # The sabotages first. Two at a time, each lab's sabotages are one scope that runs on one worker (see
    # tests/test_sabotage.py), up to a minute long: started last, one would run on while the other worker idles.
    items.sort(key=lambda item: Path(str(item.fspath)).name != "test_sabotage.py")
