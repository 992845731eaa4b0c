"""A cluster as plain values, and what one ring collective puts on each of its links.

Pure functions for :mod:`labkit.fabric` (which builds the cluster) and for the labs
(which predict before they measure). A topology is ``nodes`` machines with
``ranks_per_node`` ranks each, every node's uplink running at
``inter_node_bytes_per_s`` each way; ``zones`` groups of nodes share one uplink
each at ``cross_zone_bytes_per_s``. Rank r lives on node ``r // ranks_per_node``.
Ranks of one node share its loopback, which is not shaped and not modelled: it
stands for the fast links inside a machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from labkit.collectives import ring_bytes_per_rank

GBIT = 1e9 / 8
MAX_NODES = 250


def gbit_to_bytes_per_s(gbit_per_s: float) -> float:
    """Links are sold in Gbit/s; labkit computes in bytes per second."""
    return gbit_per_s * GBIT


@dataclass(frozen=True, kw_only=True)
class Topology:
    """The cluster as plain values. Rates are bytes per second, in each direction."""

    nodes: int
    inter_node_bytes_per_s: float
    ranks_per_node: int = 1
    zones: int = 1
    cross_zone_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= MAX_NODES:
            raise ValueError(f"nodes must be between 1 and {MAX_NODES} (one /24 of addresses), got {self.nodes}")
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")
        if self.zones < 1 or self.nodes % self.zones:
            raise ValueError(
                f"zones must be >= 1 and divide nodes evenly, got zones={self.zones} for nodes={self.nodes}: "
                "make nodes a multiple of zones"
            )
        if self.zones > 1 and self.cross_zone_bytes_per_s is None:
            raise ValueError("cross_zone_bytes_per_s is required when zones > 1: it is the rate between zones")
        if self.zones == 1 and self.cross_zone_bytes_per_s is not None:
            raise ValueError("cross_zone_bytes_per_s applies only when zones > 1: drop it or raise zones")
        for name in ("inter_node_bytes_per_s", "cross_zone_bytes_per_s"):
            rate = getattr(self, name)
            if rate is not None and not (rate > 0 and math.isfinite(rate)):
                raise ValueError(f"{name} must be a finite rate > 0 in bytes/s (1 Gbit/s is {GBIT:.0f}), got {rate}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def node_of(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ValueError(
                f"rank {rank} is outside this topology: {self.nodes} nodes x {self.ranks_per_node} ranks_per_node "
                f"holds ranks 0-{self.world_size - 1}; raise nodes or ranks_per_node"
            )
        return rank // self.ranks_per_node

    def zone_of(self, node: int) -> int:
        return node // (self.nodes // self.zones)

    def link_bytes_per_s(self, link: str) -> float:
        """Rate of a link by name: ``node<i>`` (a node's uplink) or ``zone<z>`` (a zone's uplink)."""
        rate = self.inter_node_bytes_per_s if link.startswith("node") else self.cross_zone_bytes_per_s
        if rate is None:
            raise ValueError(f"this topology has no link {link!r}: zone links exist only when zones > 1")
        return rate


def link_bytes_model(op: str, message_bytes: int, topology: Topology) -> dict[str, int]:
    """Payload bytes each link carries each way for one ring collective over ranks in order.

    Every rank sends ``ring_bytes_per_rank`` to the next; only ring edges that leave
    a node load its uplink, and only edges that leave a zone load the zone's.
    """
    per_rank = ring_bytes_per_rank(op, message_bytes, topology.world_size)
    loads = {f"node{n}": 0 for n in range(topology.nodes)}
    loads.update({f"zone{z}": 0 for z in range(topology.zones) if topology.zones > 1})
    for rank in range(topology.world_size):
        here, there = topology.node_of(rank), topology.node_of((rank + 1) % topology.world_size)
        if here != there:
            loads[f"node{here}"] += per_rank
        if topology.zone_of(here) != topology.zone_of(there):
            loads[f"zone{topology.zone_of(here)}"] += per_rank
    return loads


def predicted_s(op: str, message_bytes: int, topology: Topology, wire_bytes_per_payload_byte: float = 1.0) -> float:
    """Time of one ring collective: the busiest link's bytes at that link's rate.

    ``wire_bytes_per_payload_byte`` adds the framing (Ethernet, IP and TCP headers,
    ACKs); measure it with :func:`labkit.fabric.framing` rather than assume it.
    """
    loads = link_bytes_model(op, message_bytes, topology)
    busiest_s = max(nbytes / topology.link_bytes_per_s(link) for link, nbytes in loads.items())
    return busiest_s * wire_bytes_per_payload_byte
