"""The kernel ``labkit run`` starts: ipykernel with every socket a Unix socket, none on TCP.

``labkit run`` asks for the ``ipc`` transport, so the kernel's five channels are
Unix sockets in a private folder (:func:`labkit.course.runner.kernel_folder`).
One TCP port would still be left: ipykernel binds the pipe through which forked
children (a DataLoader's workers, a fork-server rank) send their output to the
notebook to ``tcp://127.0.0.1`` whatever the transport (``IOPubThread
._setup_pipe_in`` in ipykernel 6-7). Here that pipe is a Unix socket beside the
channels; it keeps ipykernel's own authentication (a random key each message
must carry). Run as ``python -m labkit.course.kernel -f CONNECTION_FILE``.
"""

from __future__ import annotations

import os

import zmq
from ipykernel import iostream
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


_tcp_setup_pipe_in = iostream.IOPubThread._setup_pipe_in
_tcp_setup_pipe_out = iostream.IOPubThread._setup_pipe_out


def main() -> None:
    iostream.IOPubThread._setup_pipe_in = _setup_pipe_in
    iostream.IOPubThread._setup_pipe_out = _setup_pipe_out
    IPKernelApp.launch_instance()


if __name__ == "__main__":
    main()
