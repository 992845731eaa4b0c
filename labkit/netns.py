"""Network namespaces, veth links and token-bucket shapers, driven through iproute2.

The plumbing under :mod:`labkit.fabric`: each function runs one or a few ``ip``
or ``tc`` commands and says which one failed and why. Everything here needs
root (CAP_SYS_ADMIN for namespaces, CAP_NET_ADMIN for links and qdiscs).

Namespaces labkit makes are named ``lk-<pid>-...`` after the process that made
them, so :func:`cleanup_stale` can tell which ones a killed process left behind.
Deleting a namespace deletes its veths (and so their peers) and their qdiscs.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from labkit.processes import running

NETNS_DIR = Path("/var/run/netns")
CLONE_NEWNET = 0x40000000
TBF_BURST_S = 0.001
TBF_MIN_BURST_BYTES = 128 * 1024
TBF_QUEUE_S = 0.05
TBF_QUEUE_SOCKETS = 8
"""Sockets whose queued bytes the shaper must hold at once: gloo opens several per pair of ranks."""

Port = tuple[str, str]


class NetnsError(RuntimeError):
    """An ``ip`` or ``tc`` command failed."""


def run(*argv: str) -> str:
    """Run one iproute2 command; its stdout, or :class:`NetnsError` naming the command."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"`{' '.join(argv)}` could not run: {exc}; install iproute2 (ip and tc)") from exc
    if done.returncode != 0:
        hint = "" if os.geteuid() == 0 else "; network namespaces need root"
        raise NetnsError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}{hint}")
    return done.stdout


def add_netns(name: str) -> None:
    run("ip", "netns", "add", name)
    run("ip", "-n", name, "link", "set", "lo", "up")


def delete_netns(name: str) -> None:
    """Remove a namespace's name; the kernel frees it once no process is left inside."""
    if (NETNS_DIR / name).exists():
        run("ip", "netns", "delete", name)


def add_switch(name: str) -> None:
    """A namespace holding one Linux bridge, ``br0``: the switch nodes plug into."""
    add_netns(name)
    run("ip", "-n", name, "link", "add", "br0", "type", "bridge")
    run("ip", "-n", name, "link", "set", "br0", "addrgenmode", "none", "up")


def shape(netns: str, ifname: str, bytes_per_s: float) -> None:
    """Cap what ``ifname`` sends at ``bytes_per_s`` with a token bucket (tbf).

    The bucket holds 1 ms of traffic, and at least 128 KiB: TCP hands the
    interface 64 KiB GSO packets, and a bucket smaller than a packet makes tbf cut
    each one up (CPU this box lacks). 1 ms also bounds the timer to ~1000 wake-ups
    a second, and lets a transfer run ahead of the rate by 1 ms at most.

    The queue must never overflow: a dropped segment is sent again, and the
    interface counters then count more bytes than the collective sent. TCP's
    small-queue limit lets each socket park ``tcp_limit_output_bytes`` in the
    qdisc (4 MiB on this kernel), more than 50 ms of a slow link holds (625 KB at
    0.1 Gbit/s: Lab 6 once counted 2.3% extra bytes there), so the queue holds
    that much for several sockets at once.
    """
    burst_bytes = max(int(bytes_per_s * TBF_BURST_S), TBF_MIN_BURST_BYTES)
    limit_bytes = max(int(bytes_per_s * TBF_QUEUE_S), 2 * burst_bytes, TBF_QUEUE_SOCKETS * _socket_queue_bytes())
    run("tc", "-n", netns, "qdisc", "replace", "dev", ifname, "root", "tbf",
        "rate", f"{int(bytes_per_s * 8)}bit", "burst", str(burst_bytes), "limit", str(limit_bytes))


def _socket_queue_bytes() -> int:
    """TCP's per-socket small-queue limit: the most one socket parks in a qdisc."""
    try:
        return int(Path("/proc/sys/net/ipv4/tcp_limit_output_bytes").read_text())
    except (OSError, ValueError):
        return 4 << 20


def join(upper: Port, lower: Port, bytes_per_s: float) -> None:
    """A veth from ``upper`` (a switch's netns, port name) to ``lower``; one shaper per direction.

    The upper end joins the switch's bridge. Each end's shaper caps what leaves
    that end, so both directions of the link run at ``bytes_per_s``, like a
    full-duplex NIC.
    """
    run("ip", "-n", upper[0], "link", "add", upper[1], "type", "veth", "peer", "name", lower[1], "netns", lower[0])
    for netns, ifname in (upper, lower):
        # No IPv6 link-local address: no neighbour discovery chatter in the counters.
        run("ip", "-n", netns, "link", "set", ifname, "addrgenmode", "none", "up")
        keep_in_order(netns, ifname)
        shape(netns, ifname, bytes_per_s)
    run("ip", "-n", upper[0], "link", "set", upper[1], "master", "br0")


def keep_in_order(netns: str, ifname: str) -> None:
    """Hand every packet ``ifname`` receives to one CPU's queue, so a flow arrives in the order it was sent.

    A veth passes each packet to the backlog of whichever CPU sent it, and the
    shaper's timer sends from any CPU, so packets of one flow can overtake each
    other, which no wire does. TCP takes that for loss and resends: 250-300
    spurious resends per Lab 6 run here (``nstat``: TcpRetransSegs, matched by as
    many DSACKs), up to 2% extra bytes in a window. With receive packet steering
    to CPU 0 about 20 remain, tail-loss probes of one segment each.
    """
    path = f"/sys/class/net/{ifname}/queues/rx-0/rps_cpus"
    run("ip", "netns", "exec", netns, "sh", "-c", f"echo 1 > {path}")


def counters(netns: str) -> dict[str, dict[str, int]]:
    """Per interface in one namespace: the kernel's tx/rx byte and packet counters, and what its root qdisc sent.

    A qdisc counts a TCP super-packet (GSO) as the segments it becomes, headers
    and all, so ``qdisc_sent_bytes`` is what a wire would carry; ``qdisc_drops``
    should stay 0 (see :func:`shape`).
    """
    links = json.loads(run("ip", "-n", netns, "-s", "-j", "link", "show"))
    qdiscs = json.loads(run("tc", "-n", netns, "-s", "-j", "qdisc", "show"))
    roots = {qdisc["dev"]: qdisc for qdisc in qdiscs if qdisc.get("root")}
    return {
        link["ifname"]: {
            "tx_bytes": link["stats64"]["tx"]["bytes"],
            "rx_bytes": link["stats64"]["rx"]["bytes"],
            "tx_packets": link["stats64"]["tx"]["packets"],
            "rx_packets": link["stats64"]["rx"]["packets"],
            "qdisc_sent_bytes": roots.get(link["ifname"], {}).get("bytes", 0),
            "qdisc_drops": roots.get(link["ifname"], {}).get("drops", 0),
        }
        for link in links
    }


def enter_node(netns_name: str) -> None:
    """Move this process into a node's namespace; call it before any socket is opened.

    ``setns`` moves only the calling thread, and a thread starts in the namespace of
    the thread that starts it, so call this from the main thread, first thing in a
    rank. Sockets opened earlier stay in the old namespace.
    """
    path = NETNS_DIR / netns_name
    if not path.exists():
        raise FileNotFoundError(
            f"no network namespace {netns_name!r} at {path}: is the Fabric that made it still open?"
        )
    fd = os.open(path, os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into {netns_name!r} failed: {os.strerror(errno)}; entering a node needs root")
    finally:
        os.close(fd)


def cleanup_stale() -> list[str]:
    """Delete the ``lk-<pid>-...`` namespaces whose creating process is gone; returns their names."""
    removed = []
    for path in sorted(NETNS_DIR.glob("lk-*")):
        match = re.match(r"lk-(\d+)-", path.name)
        if match and not running(int(match[1])):
            delete_netns(path.name)
            removed.append(path.name)
    return removed


REAPER = """
import os, subprocess, sys, time
pid, prefix, folder = int(sys.argv[1]), sys.argv[2], sys.argv[3]
def alive():
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
while alive():
    time.sleep(0.5)
for name in sorted(os.listdir(folder), reverse=True):
    if name.startswith(prefix + "-"):
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)
"""


def start_reaper(prefix: str) -> subprocess.Popen:
    """A small process that deletes the ``prefix-*`` namespaces once this process is gone.

    Named namespaces outlive the process that made them. A kernel killed outright
    (SIGKILL, the out-of-memory killer, a runner that was itself killed) cannot
    tear its fabric down, so a watcher in its own session does it. Plain Python,
    not labkit: importing torch would cost it a second and 100+ MB. Stop it with
    ``terminate()`` once the fabric is removed the normal way.
    """
    return subprocess.Popen([sys.executable, "-c", REAPER, str(os.getpid()), prefix, str(NETNS_DIR)],
                            start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def can_shape() -> str:
    """Try a namespace, a bridge, a veth pair and a tbf qdisc, then remove them; '' or why not."""
    if os.geteuid() != 0:
        return "network namespaces, veth links and tc need root"
    name = f"lk-{os.getpid()}-probe"
    try:
        add_switch(name)
        run("ip", "-n", name, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1")
        shape(name, "probe0", 1e9 / 8)
        return ""
    except NetnsError as exc:
        return str(exc)
    finally:
        try:
            delete_netns(name)
        except NetnsError:
            pass
