"""The sabotage harness's forked kernels behave like freshly started ones where a lab can tell."""

import os

import nbformat
from nbclient import NotebookClient

from tests.forked_kernels import ForkedKernelManager, close_zygote


def test_a_forked_kernel_takes_the_environment_folder_and_sitecustomize_it_was_started_with(tmp_path, monkeypatch):
    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['SITE_RAN'] = 'yes'\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("LABKIT_FORK_PROBE", "asked")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import os, subprocess, sys\n"
        "child = subprocess.run([sys.executable, '-c', 'import os; print(os.environ.get(\"SITE_RAN\"))'],\n"
        "                       capture_output=True, text=True).stdout.strip()\n"
        "print(os.environ['LABKIT_FORK_PROBE'], os.environ.get('SITE_RAN'), os.getcwd(), child, os.getpid())")])
    client = NotebookClient(nb, kernel_name="python3", kernel_manager_class=ForkedKernelManager,
                            resources={"metadata": {"path": str(tmp_path)}})
    try:
        client.execute()
    finally:
        close_zygote()
    probe, site_ran, cwd, child_site_ran, pid = nb.cells[0].outputs[0]["text"].split()
    assert (probe, site_ran, cwd, child_site_ran) == ("asked", "yes", str(tmp_path), "yes")
    assert not os.path.exists(f"/proc/{pid}"), "the kernel stopped with its client"
