"""A real object store on this machine: an HTTP/1.1 server, in its own process, over a folder.

:class:`ObjectStore` serves the files under ``root`` on 127.0.0.1 (the OS picks
the port) with what readers of S3-like stores rely on: whole-object ``GET``,
``Range: bytes=a-b`` / ``bytes=a-`` / ``bytes=-n`` (206, or 416 when
unsatisfiable), ``HEAD`` for the size, keep-alive. The stdlib's ``http.server``
has no Range support, so ranges are parsed here (:func:`byte_range`).

Every request is appended by the *server* to its log (JSON lines: method, path,
range, status, body bytes, the client's port -- one per connection), so request
counts come from the store, not from a client's own bookkeeping. A record is written just before its body goes out: a
client that has its answer always finds it in the log.

``first_byte_ms`` is an EMULATED condition: the server waits that long before it
answers each request, standing in for the round trip to a remote bucket that this
box does not have. So is ``bytes_per_s``: the server sends each body no faster,
as one stream from a remote bucket would arrive. It sets a condition; the bytes, the requests and the time the
clients then take are measured. :class:`HttpFetch` is the client Lab 1's
DataLoader workers use.
"""

from __future__ import annotations

import atexit
import http.client
import io
import json
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Sequence

if __name__ == "__main__":  # the server process: the labkit package would import torch (~1.6 s of start-up)
    import importlib.util

    _spec = importlib.util.spec_from_file_location("_labkit_processes", Path(__file__).with_name("processes.py"))
    processes = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(processes)
else:
    from labkit import processes

CHUNK_BYTES = 1 << 20


class RangeNotSatisfiable(ValueError):
    """A valid ``Range`` header that selects no byte of the object (HTTP 416)."""


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``(start, stop)`` (stop exclusive) that a ``Range`` header selects from ``size`` bytes.

    ``None`` means the whole object: no header, or one the server may ignore (RFC
    9110 14.2): not ``bytes=``, malformed, several ranges, or last < first.
    """
    match = re.fullmatch(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*", header or "")
    if not match or match.group(1) == match.group(2) == "":
        return None
    first, last = match.groups()
    if first == "":
        suffix = int(last)
        if suffix == 0 or size == 0:
            raise RangeNotSatisfiable(f"{header} selects nothing of {size} bytes")
        return max(size - suffix, 0), size
    if last != "" and int(last) < int(first):
        return None
    if int(first) >= size:
        raise RangeNotSatisfiable(f"{header} starts at or past the end of {size} bytes")
    return int(first), size if last == "" else min(int(last) + 1, size)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: clients reuse their connection
    disable_nagle_algorithm = True  # headers and body go out as two writes; Nagle would hold the second
    server: "_Server"

    def do_GET(self) -> None:
        """GET and HEAD; a HEAD gets the same status and headers, without the body."""
        self.arrived_s = time.time()   # the log's time_s - arrived_s: how long the request waited for its answer
        if self.server.first_byte_s:
            time.sleep(self.server.first_byte_s)
        key = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path).lstrip("/")
        path = (self.server.root / key).resolve()
        if not path.is_relative_to(self.server.root) or not path.is_file():
            return self._reply(404, f"no object {key!r} in the store (root {self.server.root})\n".encode())
        size = path.stat().st_size
        try:
            span = byte_range(self.headers.get("Range"), size)
        except RangeNotSatisfiable as exc:
            return self._reply(416, f"{exc}\n".encode(), {"Content-Range": f"bytes */{size}"})
        start, stop = span or (0, size)
        headers = {"Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        if span:
            headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
        self._head(206 if span else 200, stop - start, headers)
        if self.command == "GET":
            self._send_body(path, start, stop)

    def _send_body(self, path: Path, start: int, stop: int) -> None:
        """The bytes, paced to the emulated ``bytes_per_s`` when there is one (in 64 KiB chunks, then)."""
        rate = self.server.bytes_per_s
        chunk = min(CHUNK_BYTES, 64 << 10) if rate else CHUNK_BYTES
        began = time.monotonic()
        with open(path, "rb") as file:
            file.seek(start)
            for offset in range(start, stop, chunk):
                self.wfile.write(file.read(min(chunk, stop - offset)))
                if rate:
                    ahead_s = began + (min(offset + chunk, stop) - start) / rate - time.monotonic()
                    if ahead_s > 0:
                        time.sleep(ahead_s)

    def _reply(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self._head(status, len(body), {"Content-Type": "text/plain; charset=utf-8", **(headers or {})})
        if self.command == "GET":
            self.wfile.write(body)

    def _head(self, status: int, length: int, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in {"Content-Length": str(length), **headers}.items():
            self.send_header(name, value)
        self.server.record(method=self.command, path=self.path, range=self.headers.get("Range"), status=status,
                           bytes=length if self.command == "GET" else 0, client_port=self.client_address[1],
                           arrived_s=self.arrived_s)
        self.end_headers()

    do_HEAD = do_GET

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """A request the server does not serve (another method, a malformed line) is logged too (0 bytes)."""
        self.server.record(method=self.command, path=getattr(self, "path", None), range=None, status=code,
                           bytes=0, client_port=self.client_address[1])
        super().send_error(code, message, explain)

    def log_message(self, format: str, *args: Any) -> None:
        """Silent: the JSON request log is the record."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, root: Path, first_byte_ms: float, log_path: Path, bytes_per_s: float = 0.0) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root, self.first_byte_s, self.bytes_per_s = root, first_byte_ms / 1e3, bytes_per_s
        self._log, self._lock = open(log_path, "a", buffering=1), threading.Lock()

    def record(self, **fields: Any) -> None:
        line = json.dumps({"time_s": time.time(), **fields})
        with self._lock:
            self._log.write(line + "\n")

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client hanging up is no server error
            super().handle_error(request, client_address)


def _serve(root: str, log_path: str, first_byte_ms: str, parent_pid: str, bytes_per_s: str = "0") -> None:
    """The server process: die with the parent, bind port 0, print the port, serve until killed."""
    processes.die_with_parent()
    if os.getppid() != int(parent_pid):  # the parent died before prctl took effect (under a subreaper)
        os._exit(1)
    server = _Server(Path(root), float(first_byte_ms), Path(log_path), float(bytes_per_s))
    print(server.server_address[1], flush=True)
    sys.stdout.close()
    server.serve_forever()


_open_stores: set["ObjectStore"] = set()


class ObjectStore:
    """The files under ``root``, served over HTTP by a server process of their own.

    ``first_byte_ms`` (>= 0) is EMULATED: the server waits that long before
    answering each request, as a remote bucket's round trip would. So is
    ``bytes_per_s`` (0: as fast as the machine sends): each body arrives no faster. Requests are
    counted by the server (:meth:`log`, :meth:`requests`, :meth:`bytes_served`).

    The server stops on leaving the ``with`` block (or :meth:`close`), on an
    exception, at interpreter exit, on SIGINT (KeyboardInterrupt unwinds the
    ``with``) and on SIGTERM, which is turned into ``SystemExit`` while a store is
    open unless the program already handles SIGTERM. If the parent is killed
    outright, Linux kills the server (``processes.die_with_parent``; note that it
    fires when the *thread* that opened the store exits); only then the log folder
    in the temp dir stays behind. Give ``log_dir`` to keep the log elsewhere
    (``<log_dir>/requests.jsonl``, one store per folder).
    """

    def __init__(self, root: str | Path, first_byte_ms: float = 0.0, *, log_dir: str | Path | None = None,
                 start_timeout_s: float = 10.0, bytes_per_s: float = 0.0) -> None:
        if not 0 <= first_byte_ms < float("inf"):
            raise ValueError(f"first_byte_ms must be a finite number >= 0 (0 turns the emulated latency off), "
                             f"got {first_byte_ms}")
        if not 0 <= bytes_per_s < float("inf"):
            raise ValueError(f"bytes_per_s must be a finite number >= 0 (0 sends as fast as the machine can), "
                             f"got {bytes_per_s}")
        if not start_timeout_s > 0:
            raise ValueError(f"start_timeout_s must be > 0, got {start_timeout_s}")
        if not Path(root).is_dir():
            raise FileNotFoundError(f"root must be an existing directory of objects to serve, got {root}")
        self.root, self.first_byte_ms, self.bytes_per_s = Path(root).resolve(), first_byte_ms, bytes_per_s
        self._temp_dir = None if log_dir else tempfile.mkdtemp(prefix="labkit-objectstore-")
        folder = Path(log_dir or self._temp_dir)
        folder.mkdir(parents=True, exist_ok=True)
        self.log_path = folder / "requests.jsonl"
        self.log_path.write_text("")
        with open(folder / "server.stderr", "w+") as stderr:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", __file__, str(self.root), str(self.log_path), repr(first_byte_ms),
                 str(os.getpid()), repr(float(bytes_per_s))],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr, start_new_session=True)
            self.pid = self._proc.pid
            _open_stores.add(self)
            try:
                self.port = self._read_port(start_timeout_s, stderr)
            except BaseException:
                self.close()
                raise
        self.endpoint = f"http://127.0.0.1:{self.port}"
        processes.hold_sigterm(self)

    def _read_port(self, timeout_s: float, stderr: Any) -> int:
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
        line = self._proc.stdout.readline() if ready else b""
        self._proc.stdout.close()
        if line.strip().isdigit():
            return int(line)
        if not ready:
            raise TimeoutError(f"the object server (pid {self._proc.pid}) did not report its port within "
                               f"start_timeout_s={timeout_s:g} s; the machine may be busy: pass a larger "
                               f"start_timeout_s")
        self._proc.wait(timeout=timeout_s)
        stderr.seek(0)
        raise RuntimeError(f"the object server exited with code {self._proc.returncode} before it came up; "
                           f"its stderr ends:\n{stderr.read()[-2000:]}")

    def url(self, key: str | Path) -> str:
        """``http://127.0.0.1:PORT/<key>`` for a key relative to ``root``, or an absolute path under it."""
        if Path(key).is_absolute():
            if not Path(key).resolve().is_relative_to(self.root):
                raise ValueError(f"{key} is not under the store's root {self.root}")
            key = Path(key).resolve().relative_to(self.root).as_posix()
        return f"{self.endpoint}/{urllib.parse.quote(str(key).lstrip('/'))}"

    def log(self) -> list[dict[str, Any]]:
        """The server's request log, one dict per request, oldest first."""
        lines = self.log_path.read_text().split("\n")[:-1]  # a last line without "\n" is still being written
        return [json.loads(line) for line in lines]

    def requests(self, method: str | None = None) -> int:
        return sum(method is None or record["method"] == method for record in self.log())

    def bytes_served(self) -> int:
        return sum(record["bytes"] for record in self.log())

    def close(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and remove its temp dir; calling it twice is harmless."""
        if self._proc.poll() is None:  # once reaped, the pid may belong to another process
            processes.kill_group(self._proc.pid)
            self._proc.wait()
        _open_stores.discard(self)
        processes.release_sigterm(self)
        if self._temp_dir:
            shutil.rmtree(self._temp_dir, ignore_errors=True)

    def __enter__(self) -> "ObjectStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


atexit.register(lambda: [store.close() for store in list(_open_stores)])


@dataclass(frozen=True)
class HttpFetch:
    """Picklable ``fetch(index) -> bytes``: a GET of ``urls[index]`` over a reused connection.

    ``http.client`` rather than ``urllib.request``: urllib sends ``Connection:
    close`` and opens a new TCP connection per object, which no S3 client does.
    Each process and thread opens its own keep-alive connection on first use: one
    opened before a DataLoader forks its workers would be one socket shared by
    several processes. A connection the server has closed is reopened once (GET is
    idempotent). A 404 raises ``FileNotFoundError`` naming the URL.
    """

    urls: Sequence[str]
    timeout_s: float = 60.0

    def __len__(self) -> int:
        return len(self.urls)

    def __call__(self, index: int) -> bytes:
        return self.get(self.urls[index])

    def get(self, url: str, byte_range: tuple[int, int] | None = None) -> bytes:
        """The object's bytes, or bytes ``[start, stop)`` of it with ``byte_range``."""
        headers = {"Range": f"bytes={byte_range[0]}-{byte_range[1] - 1}"} if byte_range else {}
        response = self.request("GET", url, headers)
        body = response.read()
        if response.status == 404:
            raise FileNotFoundError(f"object {url} not found (HTTP 404): {body.decode(errors='replace').strip()}")
        if response.status != (206 if byte_range else 200):
            raise OSError(f"GET {url} answered HTTP {response.status}: {body[:200].decode(errors='replace')}")
        return body

    def request(self, method: str, url: str, headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
        """One request over this process's and thread's connection, reopened once if the server closed it.

        For a ``GET`` the caller reads the body; a ``HEAD`` has none.
        """
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http":
            raise ValueError(f"url must start with http://, got {url}")
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        for attempt in range(2):
            connection = _connection(parts.netloc, self.timeout_s)
            try:
                connection.request(method, target, headers=headers or {})
                response = connection.getresponse()
                if method == "HEAD":
                    response.read()
                return response
            except (http.client.RemoteDisconnected, ConnectionError):
                _connections.by_netloc.pop(parts.netloc).close()
                if attempt:
                    raise
        raise AssertionError("unreachable")


class RangedObject(io.RawIOBase):
    """A remote object opened for reading by ranged GETs, as a Parquet reader on S3 reads.

    A ``HEAD`` learns the size (readers seek from the end to find a footer); then
    every ``read`` is one ``Range`` request, so the server's log shows exactly the
    requests the reader made. Wrap it in ``io.BufferedReader(..., buffer_size=1)``
    (what :func:`open_ranged` returns) to keep one read one request.
    """

    def __init__(self, url: str, timeout_s: float = 60.0) -> None:
        self.url, self._fetch, self._position = url, HttpFetch([url], timeout_s), 0
        head = self._fetch.request("HEAD", url)
        if head.status != 200:
            raise FileNotFoundError(f"object {url} not found (HEAD answered HTTP {head.status})")
        self.size = int(head.getheader("Content-Length"))

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self.size}[whence]
        self._position = max(0, base + offset)
        return self._position

    def tell(self) -> int:
        return self._position

    def readinto(self, buffer: bytearray | memoryview) -> int:
        stop = min(self._position + len(buffer), self.size)
        if stop <= self._position:
            return 0
        body = self._fetch.get(self.url, byte_range=(self._position, stop))
        buffer[:len(body)] = body
        self._position += len(body)
        return len(body)


def open_ranged(url: str) -> io.BufferedReader:
    """:class:`RangedObject` for ``url``, unbuffered (one read, one request)."""
    return io.BufferedReader(RangedObject(url), buffer_size=1)


_connections = threading.local()


def _connection(netloc: str, timeout_s: float) -> http.client.HTTPConnection:
    if getattr(_connections, "pid", None) != os.getpid():  # a new thread, or a copy inherited across a fork
        _connections.pid, _connections.by_netloc = os.getpid(), {}
    if netloc not in _connections.by_netloc:
        _connections.by_netloc[netloc] = http.client.HTTPConnection(netloc, timeout=timeout_s)
    return _connections.by_netloc[netloc]


if __name__ == "__main__":
    _serve(*sys.argv[1:])
