"""The object-store server: HTTP semantics readers rely on, counts from the server's own log, and cleanup."""

import http.client
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader

from labkit.objectstore import HttpFetch, ObjectStore, RangeNotSatisfiable, byte_range
from labkit.processes import running

REPO = Path(__file__).resolve().parent.parent
SIZE = 10_000


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("objects")
    (root / "images").mkdir()
    for index in range(8):
        (root / "images" / f"{index}.bin").write_bytes(bytes([index]) * (SIZE + index))
    (root / "blob.bin").write_bytes(bytes(range(256)) * (SIZE // 256))
    return root


@pytest.fixture(scope="module")
def store(root):
    with ObjectStore(root) as store:
        yield store


def request(store, method, key, headers=None):
    connection = http.client.HTTPConnection(urllib.parse.urlsplit(store.endpoint).netloc, timeout=10)
    connection.request(method, "/" + key, headers=headers or {})
    response = connection.getresponse()
    body = response.read()
    connection.close()
    return response, body


def test_byte_range_follows_the_rfc():
    assert byte_range(None, 100) is None
    assert byte_range("bytes=10-19", 100) == (10, 20)
    assert byte_range("bytes=90-", 100) == (90, 100)
    assert byte_range("bytes=-30", 100) == (70, 100)
    assert byte_range("bytes=-300", 100) == (0, 100)
    assert byte_range("bytes=95-200", 100) == (95, 100)
    assert byte_range("bytes=20-10", 100) is None  # invalid: the server ignores it
    assert byte_range("bytes=0-1,5-6", 100) is None  # several ranges: served whole
    for unsatisfiable in ("bytes=100-", "bytes=-0"):
        with pytest.raises(RangeNotSatisfiable):
            byte_range(unsatisfiable, 100)


def test_get_returns_the_whole_object(store, root):
    response, body = request(store, "GET", "blob.bin")
    assert response.status == 200 and body == (root / "blob.bin").read_bytes()
    assert response.getheader("Accept-Ranges") == "bytes"


def test_ranged_get_returns_exactly_those_bytes(store, root):
    data = (root / "blob.bin").read_bytes()
    for header, expected in (("bytes=100-199", data[100:200]), ("bytes=9000-", data[9000:]),
                             ("bytes=-50", data[-50:])):
        response, body = request(store, "GET", "blob.bin", {"Range": header})
        assert response.status == 206 and body == expected
        start = len(data) - len(expected) if header.startswith("bytes=-") else int(header[6:].split("-")[0])
        assert response.getheader("Content-Range") == f"bytes {start}-{start + len(expected) - 1}/{len(data)}"


def test_unsatisfiable_range_is_416_with_the_size(store, root):
    response, _ = request(store, "GET", "blob.bin", {"Range": f"bytes={SIZE * 2}-"})
    assert response.status == 416
    assert response.getheader("Content-Range") == f"bytes */{(root / 'blob.bin').stat().st_size}"


def test_head_gives_the_size_and_no_body(store, root):
    response, body = request(store, "HEAD", "images/3.bin")
    assert response.status == 200 and body == b""
    assert int(response.getheader("Content-Length")) == SIZE + 3


def test_missing_object_is_404_naming_it(store):
    response, body = request(store, "GET", "images/nope.jpg")
    assert response.status == 404 and b"images/nope.jpg" in body
    with pytest.raises(FileNotFoundError, match=r"http://127\.0\.0\.1:\d+/images/nope\.jpg"):
        HttpFetch([store.url("images/nope.jpg")])(0)


def test_paths_outside_the_root_are_not_served(store):
    response, _ = request(store, "GET", "../" * 8 + "etc/passwd")
    assert response.status == 404


def test_server_log_counts_every_request_and_byte(store):
    before = store.log()
    fetch = HttpFetch([store.url(f"images/{i}.bin") for i in range(8)])
    blobs = [fetch(i) for i in range(8)]
    request(store, "HEAD", "images/0.bin")
    new = store.log()[len(before):]
    assert [(r["method"], r["status"]) for r in new] == [("GET", 200)] * 8 + [("HEAD", 200)]
    assert sum(r["bytes"] for r in new) == sum(map(len, blobs)) == 8 * SIZE + sum(range(8))
    assert len({r["client_port"] for r in new[:8]}) == 1  # HttpFetch kept one connection alive


def test_url_accepts_keys_and_absolute_paths_under_the_root(store, root):
    assert store.url("images/1.bin") == store.url(root / "images" / "1.bin") == f"{store.endpoint}/images/1.bin"
    with pytest.raises(ValueError, match="not under the store's root"):
        store.url("/etc/passwd")


def test_http_fetch_works_in_forked_dataloader_workers(store):
    fetch = pickle.loads(pickle.dumps(HttpFetch([store.url(f"images/{i}.bin") for i in range(8)])))
    fetch(0)  # a connection opened in the parent must not be shared with the workers
    before = len(store.log())
    loader = DataLoader(range(8), batch_size=None, num_workers=2,
                        collate_fn=lambda index: torch.tensor(len(fetch(index))))
    assert [int(n) for n in loader] == [SIZE + i for i in range(8)]
    new = store.log()[before:]
    assert len(new) == 8 and len({r["client_port"] for r in new}) == 2  # one connection per worker


def test_daft_download_is_one_get_per_object(store):
    daft = pytest.importorskip("daft")
    urls = [store.url(f"images/{i}.bin") for i in range(8)]
    before = store.requests("GET")
    frame = daft.from_pydict({"url": urls}).with_column("data", daft.col("url").download()).to_pydict()
    assert sorted(map(len, frame["data"])) == [SIZE + i for i in range(8)]
    assert store.requests("GET") - before == 8


def test_daft_reads_parquet_over_http_by_ranges(root, store):
    daft = pytest.importorskip("daft")
    pq.write_table(pa.table({"x": list(range(4000))}), root / "table.parquet", row_group_size=1000)
    before = len(store.log())
    assert daft.read_parquet(store.url("table.parquet")).to_pydict()["x"] == list(range(4000))
    gets = [r for r in store.log()[before:] if r["method"] == "GET"]
    assert gets and all(r["status"] == 206 for r in gets)


def _sequential_gets_s(root, first_byte_ms: float, count: int = 20) -> float:
    with ObjectStore(root, first_byte_ms=first_byte_ms) as store:
        fetch = HttpFetch([store.url("images/0.bin")])
        fetch(0)
        start = time.perf_counter()
        for _ in range(count):
            fetch(0)
        return time.perf_counter() - start


def test_first_byte_latency_is_paid_by_every_request(root):
    assert _sequential_gets_s(root, 25) >= 20 * 0.025 * 0.9
    assert _sequential_gets_s(root, 0) < 0.25


def test_an_emulated_read_rate_paces_every_body_and_bad_rates_are_refused(tmp_path):
    (tmp_path / "blob").write_bytes(os.urandom(3_000_000))
    with ObjectStore(tmp_path, bytes_per_s=20e6) as store:
        fetch = HttpFetch([store.url("blob")])
        start = time.perf_counter()
        assert len(fetch(0)) == 3_000_000
        assert time.perf_counter() - start >= 0.9 * 3_000_000 / 20e6
        assert store.bytes_served() == 3_000_000
    for bad in (-1.0, float("inf")):
        with pytest.raises(ValueError, match="bytes_per_s must be a finite number >= 0"):
            ObjectStore(tmp_path, bytes_per_s=bad)


def _servers_started_here() -> list[int]:
    """Live object-server processes whose parent is this test process."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[1]) == os.getpid() and b"objectstore.py" in (proc / "cmdline").read_bytes():
                found.append(int(proc.name)) if running(int(proc.name)) else None
        except OSError:
            continue
    return found


def test_server_is_gone_after_the_with_block_and_after_an_exception(root):
    before = _servers_started_here()
    with ObjectStore(root) as store:
        pid, log_dir = store.pid, store.log_path.parent
        assert running(pid)
    assert not running(pid) and not log_dir.exists()
    with pytest.raises(KeyError):
        with ObjectStore(root) as store:
            pid = store.pid
            raise KeyError("boom")
    assert not running(pid) and _servers_started_here() == before


OPEN_AND_WAIT = ("import time; from labkit.objectstore import ObjectStore\n"
                 "with ObjectStore({root!r}) as store:\n"
                 "    print(store.pid, store.log_path.parent, flush=True)\n"
                 "    time.sleep(60)\n")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_server_dies_when_its_parent_is_stopped(root, sig):
    parent = subprocess.Popen([sys.executable, "-c", OPEN_AND_WAIT.format(root=str(root))], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        pid, log_dir = parent.stdout.readline().split()
        assert running(int(pid))
        parent.send_signal(sig)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 5
        while running(int(pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running(int(pid))
        assert Path(log_dir).exists() == (sig == signal.SIGKILL)  # only a parent killed outright leaves it
    finally:
        parent.kill()
        parent.wait()
        shutil.rmtree(log_dir, ignore_errors=True)


def test_bad_input_names_the_argument_and_the_fix(root, tmp_path):
    before = _servers_started_here()
    with pytest.raises(ValueError, match="first_byte_ms must be a finite number >= 0"):
        ObjectStore(root, first_byte_ms=-1)
    with pytest.raises(FileNotFoundError, match="root must be an existing directory"):
        ObjectStore(tmp_path / "absent")
    with pytest.raises(TimeoutError, match="pass a larger start_timeout_s"):
        ObjectStore(root, start_timeout_s=1e-6)
    assert _servers_started_here() == before
    with pytest.raises(ValueError, match="url must start with http://"):
        HttpFetch(["s3://bucket/key"])(0)
