"""The kernel ``labkit run`` starts: ipykernel with every socket a Unix socket, none on TCP.

``labkit run`` asks for the ``ipc`` transport, so the kernel's five channels are
Unix sockets in a private folder (:func:`labkit.course.runner.kernel_folder`).
One TCP port would still be left: ipykernel binds the pipe through which forked
children (a DataLoader's workers, a fork-server rank) send their output to the
notebook to ``tcp://127.0.0.1`` whatever the transport (``IOPubThread
._setup_pipe_in`` in ipykernel 6-7). Here that pipe is a Unix socket beside the
channels; it keeps ipykernel's own authentication (a random key each message
must carry). Run as ``python -m labkit.course.kernel -f CONNECTION_FILE``.

At shutdown ipykernel stops the children in its process group, SIGTERM first, checking again after
0.01, 0.03, 0.1, 0.3, 1 and 3 s. multiprocessing's resource tracker, which any lab that starts a process
from Python starts too, ignores SIGTERM, so the kernel outlived the runner's patience (then 2.5 s) and was
killed: a one-cell notebook that started the tracker took 4.1 s to run against 2.1 s, and one that
launched a rank 5.4 s (its fork server, once stopped, stays listed as a zombie). This kernel leaves the
tracker and the dead out of that list; the tracker exits by itself once the kernel, the last holder of its
pipe, has gone.
"""

from __future__ import annotations

import os
from multiprocessing import resource_tracker

import zmq
from ipykernel import iostream
from ipykernel.ipkernel import IPythonKernel
from ipykernel.kernelapp import IPKernelApp
from zmq.eventloop.zmqstream import ZMQStream


def _pipe_address() -> str:
    app = IPKernelApp.instance()
    return f"ipc://{app.ip}-iopub-pipe" if app.transport == "ipc" else ""


def _setup_pipe_in(self: iostream.IOPubThread) -> None:
    address = _pipe_address()
    if not address:
        return _tcp_setup_pipe_in(self)
    self._pipe_uuid = os.urandom(16)
    pipe_in = self.socket.context.socket(zmq.PULL)
    pipe_in.linger = 0
    pipe_in.bind(address)
    self._pipe_address = address
    self._pipe_in = ZMQStream(pipe_in, self.io_loop)
    self._pipe_in.on_recv(self._handle_pipe_msg)


def _setup_pipe_out(self: iostream.IOPubThread):
    address = getattr(self, "_pipe_address", "")
    if not address:
        return _tcp_setup_pipe_out(self)
    ctx = zmq.Context()  # a new context after fork, as ipykernel does
    pipe_out = ctx.socket(zmq.PUSH)
    pipe_out.linger = 3000
    pipe_out.connect(address)
    return ctx, pipe_out


class _Kernel(IPythonKernel):
    def _process_children(self) -> list:
        """The children ipykernel stops at shutdown, less multiprocessing's resource tracker and the dead.

        A child that has exited stays a zombie until its parent waits for it, and nothing waits for a
        launcher's fork server: listed, it kept the kernel signalling and sleeping as if it still ran.
        """
        tracker = resource_tracker._resource_tracker._pid
        return [child for child in super()._process_children() if child.pid != tracker and _running(child)]


def _running(child) -> bool:
    import psutil   # ipykernel's own dependency

    try:
        return child.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


_tcp_setup_pipe_in = iostream.IOPubThread._setup_pipe_in
_tcp_setup_pipe_out = iostream.IOPubThread._setup_pipe_out


def main() -> None:
    iostream.IOPubThread._setup_pipe_in = _setup_pipe_in
    iostream.IOPubThread._setup_pipe_out = _setup_pipe_out
    IPKernelApp.launch_instance(kernel_class=_Kernel)


if __name__ == "__main__":
    main()
