"""A miniature cluster on one machine: nodes as network namespaces, joined by shaped links.

The sleep-based emulation in :mod:`labkit.collectives` adds the time a model
predicts; it cannot show what the model leaves out. Here every node is a Linux
network namespace, nodes reach each other only through veth pairs into a switch
(a Linux bridge in its own namespace), and a token bucket on both ends of every
veth caps each direction at the link's rate, as a full-duplex NIC would. Ranks are
real processes that enter their node before they open a socket, so gloo's bytes
really cross the links, the kernel counts them (:meth:`Fabric.link_bytes`) and
the clock measures them.

Layout: ``zones`` switches with ``nodes / zones`` nodes each; with more than one
zone, each switch has one uplink, shaped at ``cross_zone_bytes_per_s``, to a core
switch. Rank r lives on node ``r // ranks_per_node``; ranks of one node talk over
its loopback, unshaped, as GPUs inside one machine talk over fast local links.

A fabric needs root. :func:`probe` tries once and says which mode labs run in;
where it says ``"emulated"`` labs fall back to the sleep emulation and say so.
(``unshare --user --map-root-user --net`` gives an unprivileged user one namespace
whose loopback can be shaped, but not the named namespaces a fabric joins.)

Teardown: on leaving the ``with`` block, on exceptions, at interpreter exit, and on
SIGTERM, which is turned into ``SystemExit`` while a fabric is open, unless the
program already handles SIGTERM. A process killed outright cannot tear down; a
reaper process in its own session (:func:`labkit.netns.start_reaper`) deletes its
namespaces once it is gone, and the next fabric's :func:`cleanup_stale` removes any
whose creator is dead.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import os
import subprocess
import time
from dataclasses import astuple, dataclass
from typing import Any

from labkit.netns import (NetnsError, Port, add_netns, add_switch, can_shape, cleanup_stale, counters, delete_netns,
                          start_reaper)
from labkit.netns import join, run
from labkit.processes import hold_sigterm, release_sigterm
from labkit.topology import Topology

UPLINK = "uplink"
SUBNET = "10.213.0"
MASTER_PORT = 29500


# Every packet an interface counts carries one set of headers: Ethernet 14 + IPv4 20 +
# TCP 20 + the timestamp option 12, which Linux turns on in every new namespace.
HEADER_BYTES = 66
# Wire bytes per payload byte a shaped link can show. Every full 1448-byte segment pays
# 66 bytes of headers (1.046), and the receiver may send up to one bare ACK per segment,
# which crosses the same direction's shaper when traffic flows both ways (1.091); gloo's
# small messages add a little. Outside this band the shaper did not count the link.
WIRE_PER_PAYLOAD_BAND = (1.04, 1.10)


def tcp_payload(interface_bytes: int, packets: int) -> int:
    """What the sockets wrote, from an interface's byte and packet counters: one set of headers per packet off."""
    return interface_bytes - HEADER_BYTES * packets


@dataclass(frozen=True)
class LinkBytes:
    """Kernel counters of one link, seen from its lower end (node or zone): tx goes up, rx down.

    ``tx_bytes`` and ``rx_bytes`` are the interface's counters. TCP hands it 64 KiB
    super-packets (GSO; a NIC would cut them up, TSO) with one set of headers each,
    so they count little beyond the payload, plus the ACKs for the other
    direction: headers only, and how many depends on how the receiver's reads
    line up with the sender's writes, which load changes (1.002-1.05x the
    payload over one set of runs). ``*_payload_bytes`` subtract one set of headers
    per counted packet: what the ranks wrote to their TCP sockets, ACKs gone.
    ``*_wire_bytes`` come from the link's shapers, which charge every packet the
    headers it carries once cut to the MTU: the bytes a real wire carries, and the
    bytes the link's time is paid in.
    """

    tx_bytes: int
    rx_bytes: int
    tx_packets: int
    rx_packets: int
    tx_wire_bytes: int
    rx_wire_bytes: int

    @property
    def tx_payload_bytes(self) -> int:
        return tcp_payload(self.tx_bytes, self.tx_packets)

    @property
    def rx_payload_bytes(self) -> int:
        return tcp_payload(self.rx_bytes, self.rx_packets)

    def __sub__(self, other: LinkBytes) -> LinkBytes:
        return LinkBytes(*(a - b for a, b in zip(astuple(self), astuple(other))))


def delta(before: dict[str, LinkBytes], after: dict[str, LinkBytes]) -> dict[str, LinkBytes]:
    """What crossed each link between two :meth:`Fabric.link_bytes` snapshots."""
    return {link: after[link] - before[link] for link in after}


def framing(traffic: dict[str, LinkBytes], payload_bytes: dict[str, int]) -> float:
    """Measured wire bytes per payload byte, over the links the payload crossed.

    ``payload_bytes`` is what the model says each link carried upward (for several
    calls, multiply). Headers, ACKs and gloo's own handshakes make up the rest.
    """
    carried = [link for link, nbytes in payload_bytes.items() if nbytes > 0]
    if not carried:
        raise ValueError("payload_bytes has no link that carried payload: nothing to measure framing against")
    return sum(traffic[link].tx_wire_bytes for link in carried) / sum(payload_bytes[link] for link in carried)


@dataclass(frozen=True)
class Node:
    index: int
    zone: int
    netns: str
    address: str


_fabric_ids = itertools.count()
_open_fabrics: set[Fabric] = set()
_reapers: dict[str, subprocess.Popen] = {}
"""Each open fabric's reaper, by prefix: kept outside the fabric, which ranks receive pickled."""


class Fabric:
    """Namespaces, veths and shapers for one :class:`Topology`, all removed on exit.

    ``with Fabric(topology) as fab:`` then start rank r with ``env=fab.rank_env(r)``;
    each rank calls ``enter_node(os.environ["LABKIT_NETNS"])`` before it opens a
    socket (``labkit.launcher.launch(fn, world_size, fabric=fab)`` does both).
    """

    def __init__(self, topology: Topology):
        self.topology = topology
        self.prefix = f"lk-{os.getpid()}-{next(_fabric_ids)}"
        self.nodes = [
            Node(n, topology.zone_of(n), f"{self.prefix}-node{n}", f"{SUBNET}.{n + 1}") for n in range(topology.nodes)
        ]
        self.switches = [f"{self.prefix}-switch{z}" for z in range(topology.zones)]
        self.core = f"{self.prefix}-core" if topology.zones > 1 else None
        # link name -> (lower end, upper end), each a (netns, interface)
        self.links: dict[str, tuple[Port, Port]] = {
            f"node{n.index}": ((n.netns, UPLINK), (self.switches[n.zone], f"node{n.index}")) for n in self.nodes
        }
        if self.core:
            self.links.update({f"zone{z}": ((s, "core"), (self.core, f"zone{z}")) for z, s in enumerate(self.switches)})
        self._created: list[str] = []

    def __enter__(self) -> Fabric:
        cleanup_stale()
        _open_fabrics.add(self)
        hold_sigterm(self)
        _reapers[self.prefix] = start_reaper(self.prefix)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def _build(self) -> None:
        for switch in [*self.switches, *([self.core] if self.core else [])]:
            self._created.append(switch)
            add_switch(switch)
        for node in self.nodes:
            self._created.append(node.netns)
            add_netns(node.netns)
        for link, (lower, upper) in self.links.items():
            join(upper, lower, self.topology.link_bytes_per_s(link))
        for switch in self.switches if self.core else []:
            run("ip", "-n", switch, "link", "set", "core", "master", "br0")
        for node in self.nodes:
            run("ip", "-n", node.netns, "addr", "add", f"{node.address}/24", "dev", UPLINK)

    def close(self) -> None:
        """Delete every namespace this fabric made; their veths and shapers go with them."""
        errors = []
        for name in reversed(self._created):
            try:
                delete_netns(name)
            except NetnsError as exc:
                errors.append(str(exc))
        self._created.clear()
        _open_fabrics.discard(self)
        release_sigterm(self)
        reaper = _reapers.pop(self.prefix, None)
        if reaper is not None:
            reaper.terminate()
            reaper.wait()
        if errors:
            raise NetnsError("could not remove every namespace:\n" + "\n".join(errors))

    def rank_env(self, rank: int) -> dict[str, str]:
        """What a launcher adds to rank ``rank``'s environment: its node, and how gloo reaches rank 0."""
        node = self.nodes[self.topology.node_of(rank)]
        return {
            "LABKIT_NETNS": node.netns,
            "MASTER_ADDR": self.nodes[0].address,
            "MASTER_PORT": str(MASTER_PORT),
            "GLOO_SOCKET_IFNAME": UPLINK,
            "LOCAL_RANK": str(rank % self.topology.ranks_per_node),
            "LOCAL_WORLD_SIZE": str(self.topology.ranks_per_node),
        }

    def link_bytes(self) -> dict[str, LinkBytes]:
        """Kernel counters of every link (``node<i>``, then ``zone<z>``); see :class:`LinkBytes`."""
        if not self._created:
            raise RuntimeError("this fabric is not up: read its links inside `with Fabric(topology) as fab:`")
        seen = {netns: counters(netns) for netns in self._created}
        snapshot = {}
        for link, ((lower_ns, lower_if), (upper_ns, upper_if)) in self.links.items():
            lower, upper = seen[lower_ns][lower_if], seen[upper_ns][upper_if]
            snapshot[link] = LinkBytes(
                tx_bytes=lower["tx_bytes"],
                rx_bytes=lower["rx_bytes"],
                tx_packets=lower["tx_packets"],
                rx_packets=lower["rx_packets"],
                tx_wire_bytes=lower["qdisc_sent_bytes"],
                rx_wire_bytes=upper["qdisc_sent_bytes"],
            )
        return snapshot


def set_link_rates(links: dict[str, tuple[Port, Port]], bytes_per_s: float) -> None:
    """Reshape both ends of every link in ``links`` (a fabric's ``links``) to ``bytes_per_s``.

    One fabric can then serve a whole experiment at several rates; a rank of a
    running job may call it between collectives (it needs root, like the fabric).
    """
    from labkit import netns

    for lower, upper in links.values():
        for netns_name, ifname in (lower, upper):
            netns.shape(netns_name, ifname, bytes_per_s)


def collective_rank(op: str = "all_reduce", message_bytes: int = 64 * 2**20, repeats: int = 3) -> dict[str, Any]:
    """Rank function: best of ``repeats`` timed calls of one fp32 collective, after one warm-up.

    The warm-up opens gloo's connections; each timed call starts at a barrier, so
    no rank's clock includes waiting for a late peer. ``message_bytes`` follows
    nccl-tests: the all-reduce tensor, the all-gather output, the reduce-scatter input.
    """
    import torch
    import torch.distributed as dist

    world_size = dist.get_world_size()
    if message_bytes % (4 * world_size):
        raise ValueError(f"message_bytes must be a multiple of 4 x world_size = {4 * world_size}, got {message_bytes}")
    full = torch.ones(message_bytes // 4)
    shard = torch.ones(message_bytes // 4 // world_size)
    # torch 2.13 renamed the *_tensor forms; older torch has only those.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    run_op = {
        "all_reduce": lambda: dist.all_reduce(full),
        "all_gather": lambda: all_gather(full, shard),
        "reduce_scatter": lambda: reduce_scatter(shard, full),
    }[op]
    run_op()
    times_s = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        run_op()
        times_s.append(time.perf_counter() - start)
    return {"rank": dist.get_rank(), "op": op, "best_s": min(times_s), "times_s": times_s}


@dataclass(frozen=True)
class Capability:
    mode: str
    reason: str


@functools.cache
def probe() -> Capability:
    """Which links labs get here: ``"namespaces"`` (real, shaped) or ``"emulated"`` (sleeps), and why.

    Tries a namespace, a bridge, a veth pair and a tbf shaper once per process,
    then removes them.
    """
    why_not = can_shape()
    if why_not:
        return Capability("emulated", f"{why_not}; links are emulated with sleeps (labkit.collectives)")
    return Capability("namespaces", "network namespaces, a bridge, veth pairs and tbf work: links are real and shaped")


def _close_all() -> None:
    for fabric in list(_open_fabrics):
        fabric.close()


atexit.register(_close_all)
