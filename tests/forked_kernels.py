"""Kernels forked from a process that has already imported torch, for every sabotage test and every notebook.

Each sabotage runs part of a notebook in a fresh kernel, and a fresh kernel spent about 1.9 s
starting Python, ipykernel, torch, NumPy and PyArrow before its first cell (measured with
nbclient on a one-cell notebook): the 47 sabotages of the time cost the suite about 90 s. nbval's
notebooks start theirs the same way (four one-cell notebooks that import torch and labkit: 8.05 s
under nbval with fresh kernels, 4.93 s forked). Here one *zygote*
process imports those once, and each kernel is a ``fork()`` of it, started by a jupyter_client
provisioner that asks the zygote instead of running ``python -m ipykernel_launcher``.

What a kernel sees is unchanged where it matters to a lab: the zygote never imports labkit
(the sabotage's ``sitecustomize`` hook still runs before labkit's first import, see
``test_sabotage._AFTER_LABKIT``), the child takes the environment and folder the kernel
manager asked for, and everything the lab starts (ranks, loaders' workers, servers) is started
by the kernel as before. The zygote starts from pytest's environment, and the harness adds only
PYTHONPATH and LABKIT_SOLUTIONS, which the preloaded modules do not read at import; ipykernel reads
its parent's pid (JPY_PARENT_PID) at import, so the kernel gets it on its command line instead.
matplotlib, whose backend follows ``MPLBACKEND`` and the kernel, is not preloaded.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from jupyter_client.manager import AsyncKernelManager, KernelManager
from jupyter_client.provisioning import LocalProvisioner

PRELOAD = ("torch", "numpy", "pyarrow", "PIL.Image", "ipykernel.kernelapp")
START_TIMEOUT_S = 120
_STARTING_ENV = dict(os.environ)
_PR_SET_PDEATHSIG = 1


def _die_with_parent(sig: int) -> None:
    """Ask Linux to send this process ``sig`` when its parent exits (prctl), so nothing outlives pytest."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)


def _take_python_path(env: dict[str, str]) -> None:
    """Do what interpreter start-up would have done with the kernel's PYTHONPATH: put the folders the
    zygote lacks first on sys.path, and run a ``sitecustomize.py`` found among them."""
    new = [folder for folder in env.get("PYTHONPATH", "").split(os.pathsep) if folder and folder not in sys.path]
    sys.path[:0] = new
    for folder in new:
        site = Path(folder) / "sitecustomize.py"
        if site.exists():
            exec(compile(site.read_text(), str(site), "exec"), {"__name__": "sitecustomize"})
            return


def _become_kernel(request: dict[str, Any]) -> None:
    """In the forked child: take the requested environment and folder, then run ipykernel."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()
    _die_with_parent(signal.SIGTERM)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    _take_python_path(request["env"])
    sys.path.insert(0, request["cwd"])   # as `python -m ipykernel_launcher` started there would have it
    from ipykernel.kernelapp import IPKernelApp

    # ipykernel read JPY_PARENT_PID when the zygote imported it: name the parent on the command line
    sys.argv = ["ipykernel_launcher", "-f", request["connection_file"],
                f"--IPKernelApp.parent_handle={request['env']['JPY_PARENT_PID']}"]
    IPKernelApp.launch_instance(argv=sys.argv[1:])


def serve(socket_path: str) -> None:
    """The zygote: preload, then fork one kernel per request and answer with its pid."""
    _die_with_parent(signal.SIGKILL)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [folder for folder in sys.path if folder != here]   # run as a script: no kernel imports from tests/
    for name in PRELOAD:
        __import__(name)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)   # the kernel's exit is seen by its pid; no zombies
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(socket_path + ".new")
    server.listen()
    os.rename(socket_path + ".new", socket_path)   # the name appears only once it accepts
    while True:
        connection, _ = server.accept()
        with connection:
            request = json.loads(connection.makefile().readline())
            pid = os.fork()
            if pid == 0:
                server.close()
                connection.close()
                try:
                    _become_kernel(request)
                finally:
                    os._exit(0)
            connection.sendall(f"{pid}\n".encode())


class _Zygote:
    """The zygote process of this pytest run, started on first use."""

    def __init__(self) -> None:
        self.folder = tempfile.TemporaryDirectory(prefix="labkit-zygote-")
        self.socket_path = os.path.join(self.folder.name, "socket")
        # The environment pytest started with: a sabotage's PYTHONPATH holds a sitecustomize that every kernel
        # forked from the zygote would inherit. Each kernel takes its own PYTHONPATH (_take_python_path).
        self.process = subprocess.Popen([sys.executable, __file__, self.socket_path], env=_STARTING_ENV)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not os.path.exists(self.socket_path):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the kernel zygote did not start within {START_TIMEOUT_S} s")
            time.sleep(0.05)

    def fork(self, request: dict[str, Any]) -> int:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(self.socket_path)
            client.sendall((json.dumps(request) + "\n").encode())
            return int(client.makefile().readline())

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        self.folder.cleanup()


_zygote: _Zygote | None = None


def zygote() -> _Zygote:
    global _zygote
    if _zygote is None or _zygote.process.poll() is not None:
        _zygote = _Zygote()
    return _zygote


def close_zygote() -> None:
    global _zygote
    if _zygote is not None:
        _zygote.close()
        _zygote = None


class _ForkedProcess:
    """What jupyter_client asks of a kernel's Popen, for a process that is not our child."""

    stdin = stdout = stderr = None

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not _alive(self.pid):
            self.returncode = 0
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("kernel", timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (the zygote ignores SIGCHLD, so an exited kernel leaves no zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class ForkedProvisioner(LocalProvisioner):
    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> Any:
        connection_file = cmd[cmd.index("-f") + 1]
        # jupyter_client's launcher names the kernel's parent the same way (ipykernel then prints no console note)
        env = {**kwargs.get("env", os.environ), "JPY_PARENT_PID": str(os.getpid())}
        pid = zygote().fork({"connection_file": connection_file, "env": env,
                             "cwd": str(kwargs.get("cwd") or os.getcwd())})
        self.process = _ForkedProcess(pid)
        self.pid = self.pgid = pid   # the kernel leads its own session, as LocalProvisioner's kernels do
        self.cwd = kwargs.get("cwd", os.getcwd())
        return self.connection_info


class _Forked:
    """Kernels that are forks of the zygote.

    jupyter_client picks a provisioner from the kernel spec only when none is set yet, so setting
    ours first is the one hook needed; everything else (ports, connection file, shutdown) is its own.
    """

    async def _async_pre_start_kernel(self, **kw: Any) -> Any:
        if self.provisioner is None:
            self.kernel_id = self.kernel_id or kw.pop("kernel_id", None) or os.urandom(16).hex()
            self.provisioner = ForkedProvisioner(kernel_id=self.kernel_id, kernel_spec=self.kernel_spec, parent=self)
        return await super()._async_pre_start_kernel(**kw)


class ForkedKernelManager(_Forked, AsyncKernelManager):
    """For nbclient's NotebookClient (the sabotage tests)."""


class ForkedSyncKernelManager(_Forked, KernelManager):
    """For nbval, which starts a notebook's kernel with the blocking manager (see the root conftest.py)."""


if __name__ == "__main__":
    serve(sys.argv[1])
