"""Run All twice in one kernel, as learners do: every lab must pass its second pass too.

A second pass finds state a lab leaves behind: a runner that can be set once, a
checkpoint folder the next run resumes from by mistake, a cache built at another
size. Each notebook's cells are executed in order, then all of them again, in one
kernel. Exit status 1 when a lab fails either pass.

    python benchmarks/run_all_twice.py [LAB ...]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from labkit.course import notebooks_dir, select
from labkit.launcher import remove_stale_dirs


def run_twice(notebook: str, timeout_s: int = 900) -> str:
    """"" when both passes passed, else which pass and cell failed, with the error's last line."""
    nb = nbformat.read(notebooks_dir() / notebook, as_version=4)
    count = len(nb.cells)
    nb.cells = nb.cells + copy.deepcopy(nb.cells)
    try:
        NotebookClient(nb, timeout=timeout_s, kernel_name="python3",
                       resources={"metadata": {"path": str(notebooks_dir())}}).execute()
    except CellExecutionError as exc:
        index = next(i for i, cell in enumerate(nb.cells)
                     if any(out.get("output_type") == "error" for out in cell.get("outputs", [])))
        last = [line for line in str(exc).splitlines() if line.strip()][-1]
        return f"pass {index // count + 1}, cell {index % count}: {last}"
    finally:
        # nbclient's plain kernel is SIGTERMed at shutdown before a lab's exit hooks run (labkit run waits for
        # them: labkit/course/kernel.py); sweep what it left, as labkit run does after every lab
        remove_stale_dirs()
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("labs", nargs="*", default=["all"])
    args = parser.parse_args(argv)
    failed = 0
    for lab in select(args.labs):
        start = time.monotonic()
        problem = run_twice(lab.notebook)
        failed += bool(problem)
        print(f"lab {lab.number} {lab.slug}: {'passed twice' if not problem else 'FAILED ' + problem} "
              f"({time.monotonic() - start:.0f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
