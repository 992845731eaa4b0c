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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    """A failed notebook cell's report carries what the cell printed before it failed.

    nbval reports only the traceback, and a lab's asserts are about values the cell has just printed (the
    "what we saw" sentences): without them a failure in a CI log cannot be told from a near miss.
    """
    report = yield
    outputs = getattr(item, "test_outputs", None)
    if report.failed and call.when == "call" and outputs:
        report.sections.append(("Captured cell output", cell_output_text(outputs)))
    return report


def cell_output_text(outputs: list[dict]) -> str:
    """The text of a cell's outputs as nbval collected them: streams, and each display's Markdown or plain text."""
    texts = [out.get("text") or out.get("data", {}).get("text/markdown") or out.get("data", {}).get("text/plain")
             for out in outputs]
    return "\n".join(text if isinstance(text, str) else "".join(text) for text in texts if text)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).suffix == ".ipynb":
            item.add_marker(pytest.mark.alone)
    # The sabotages first. Two at a time, each lab's sabotages are one scope that runs on one worker (see
    # tests/test_sabotage.py), up to a minute long: started last, one would run on while the other worker idles.
    items.sort(key=lambda item: Path(str(item.fspath)).name != "test_sabotage.py")
