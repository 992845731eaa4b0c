"""The links Lab 5's ranks talk over: real shaped links on a fabric, or the sleep emulation.

Where :func:`labkit.fabric.probe` allows, each rank sits on its own node of a
:class:`labkit.fabric.Fabric` and gloo's bytes cross a real veth whose tbf shaper
sets the rate: the time is measured and the kernel counts the bytes
(:func:`uplink_bytes`). Elsewhere (no root, macOS, Binder, NCCL ranks, or
``LABKIT_FABRIC=emulated``) ``CommCounter`` sleeps the ring model's time for the
counted bytes over :func:`emulated_link`, so the lab still runs, but its
throughput then follows from the model and is not evidence for it.
:func:`link_mode` decides which, and says why, so every result can carry it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

from labkit.collectives import Link
from labkit.topology import Topology, gbit_to_bytes_per_s

EMULATED_ENV = "LABKIT_FABRIC"


@dataclasses.dataclass(frozen=True)
class LinkMode:
    """Which links a run gets: ``"namespaces"`` (real, shaped) or ``"emulated"`` (sleeps), and why."""

    mode: str
    reason: str

    @property
    def label(self) -> str:
        if self.mode == "namespaces":
            return "real shaped links (namespaces)"
        return f"emulated (sleep): {self.reason}"


def link_mode(backend: str = "gloo") -> LinkMode:
    """Real shaped links where a fabric can be built, else the sleep emulation; ``LABKIT_FABRIC=emulated`` forces it."""
    if os.environ.get(EMULATED_ENV, "") == "emulated":
        return LinkMode("emulated", f"{EMULATED_ENV}=emulated is set")
    if backend != "gloo":
        return LinkMode("emulated", f"{backend} ranks talk over device links, not over the fabric's sockets")
    from labkit import fabric

    capability = fabric.probe()
    return LinkMode(capability.mode, capability.reason)


def emulated_link(rate_gbit: float) -> Link:
    """The sleep emulation's link at ``rate_gbit``; no latency, like the shaped link (tbf adds none)."""
    return Link(f"{rate_gbit:g} Gbit/s (emulated)", bandwidth_gbps=rate_gbit, latency_us=0.0)


def set_link_rate(links: dict[str, tuple[tuple[str, str], tuple[str, str]]], rate_gbit: float) -> None:
    """Reshape every fabric link to ``rate_gbit`` (:func:`labkit.fabric.set_link_rates`)."""
    from labkit.fabric import set_link_rates

    set_link_rates(links, gbit_to_bytes_per_s(rate_gbit))


def uplink_bytes() -> tuple[int, int]:
    """(TCP payload sent, wire bytes its shaper sent) of this rank's node uplink, from the kernel; (0, 0) off a fabric.

    The payload is the interface's bytes less one set of headers per packet
    (:class:`labkit.fabric.LinkBytes`), so the ACKs for the other direction drop out.
    """
    name = os.environ.get("LABKIT_NETNS")
    if not name:
        return 0, 0
    from labkit.fabric import UPLINK, tcp_payload
    from labkit.netns import counters

    uplink = counters(name)[UPLINK]
    return tcp_payload(uplink["tx_bytes"], uplink["tx_packets"]), uplink["qdisc_sent_bytes"]


def two_node_topology(world_size: int, rate_gbit: float) -> Topology:
    """One rank per node, every node's uplink at ``rate_gbit`` each way: the 2019 cluster in miniature."""
    return Topology(nodes=world_size, ranks_per_node=1, inter_node_bytes_per_s=gbit_to_bytes_per_s(rate_gbit))


def launch_over_links(rank_fn: Callable[..., Any], world_size: int, rate_gbit: float, mode: LinkMode, /, *,
                      backend: str, timeout_s: float, **kwargs: Any) -> list[Any]:
    """``rank_fn`` on ``world_size`` ranks, one per node of a fabric whose links run at ``rate_gbit``, where
    ``mode`` is real links; otherwise plain ranks on this machine (the emulation sleeps inside them).
    The fabric's links reach the ranks as ``links=`` to reshape; the fabric is gone when this returns.
    The first four are positional only, so ``kwargs`` for the ranks may carry a ``rate_gbit`` of their own."""
    from labkit.launcher import launch

    if mode.mode != "namespaces":
        return launch(rank_fn, world_size, backend=backend, timeout_s=timeout_s, **kwargs)
    from labkit import fabric

    with fabric.Fabric(two_node_topology(world_size, rate_gbit)) as fab:
        return launch(rank_fn, world_size, backend=backend, timeout_s=timeout_s, fabric=fab, links=fab.links,
                      **kwargs)
