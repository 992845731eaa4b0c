"""Placement measured on real links: one data-parallel job, inside one zone and across zones.

:mod:`labkit.placement` prices a step as compute plus one ring all-reduce over the
slowest link a job's placement crosses. This module gives it link costs measured
on a :class:`labkit.fabric.Fabric` instead of a table. One fabric of two zones of
two nodes (1 Gbit/s node links, zones joined at 0.25 Gbit/s) runs the same small
data-parallel job twice, one rank per node: on both nodes of one zone, then on one
node in each zone. Two ranks, not four: two ranks' compute fits this 2-core box's
two cores, four would share them and time each other's work. For
each placement we keep

* the job's step time and its compute time per step (the slowest rank's),
* its gradient all-reduce alone, timed as nccl-tests time it: that gives the
  effective bandwidth of the scope (scope ``"zone"``, scope ``"cluster"`` = across zones),
* the bytes the kernel counted on the zone links (none when the job stays in its zone).

Which scopes are measured and which stay assumed (:func:`fleet_links`):

* ``zone`` and ``cluster``: measured, as effective bandwidths. The fabric is a
  miniature: its node links stand for the table's 400G InfiniBand ports and its
  cross-zone links for 100G Ethernet (the same 4:1 ratio), so ``scale`` multiplies
  every measured rate by 400. What the measurement adds to the table is what the
  stack really achieves on those links: framing, gloo's copies, the ring's pace.
* ``node``: assumed, 6x the measured in-zone rate (the table's NVLink/InfiniBand
  ratio). Ranks of one fabric node share an unshaped loopback, which measures
  this box's memory copies, not a GPU interconnect.
* ``fleet``: assumed, 1/4 of the measured cross-zone rate (the table's WAN/Ethernet
  ratio). The fabric has no second cluster.
* latencies: the table's, for every scope. Token buckets shape bandwidth only; this
  kernel has no ``netem`` to add delay. They are a few hundred microseconds per step
  at most, against tens of milliseconds of transfer here.

Where :func:`labkit.fabric.probe` says ``"emulated"`` nothing is measured and
:func:`fleet_links` returns the assumed table, saying so in every link's name.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from labkit import fabric
from labkit.collectives import Link, ring_bytes_per_rank
from labkit.devices import load_average
from labkit.launcher import launch, rank_info
from labkit.netns import run
from labkit.profiles import require_at_least
from labkit.fleet_model import DEFAULT_LINKS, SCOPES, Job, step_time_s
from labkit.topology import GBIT, Topology, link_bytes_model

FABRIC = Topology(nodes=4, zones=2, inter_node_bytes_per_s=1 * GBIT, cross_zone_bytes_per_s=0.25 * GBIT)
PLACEMENTS = {"in one zone": (0, 1), "across zones": (0, 2)}
# The fabric's 1 Gbit/s node links stand for the table's 400G zone links.
FABRIC_SCALE = DEFAULT_LINKS["zone"].bandwidth_gbps / (FABRIC.inter_node_bytes_per_s / GBIT)
NODE_OVER_ZONE = DEFAULT_LINKS["node"].bandwidth_gbps / DEFAULT_LINKS["zone"].bandwidth_gbps
FLEET_OVER_CLUSTER = DEFAULT_LINKS["fleet"].bandwidth_gbps / DEFAULT_LINKS["cluster"].bandwidth_gbps
# Bands from repeats of measure_placements on the 2-core box at load average 10-20 (others' ranks running),
# 2026-12-03; rerun them with benchmarks/lab08_recovery_and_placement.py --only-fabric.
# Effective bandwidth over the shaped rate of the slowest link. Seen over 8 repeats: in one zone 0.56-0.94
# (gloo's copies and TCP at 1 Gbit/s need CPU the load takes), across zones 0.86-0.96. Above 1.05 the link
# was not shaped: a token bucket lets a transfer run ahead by its 128 KiB bucket only, 3% of one all-reduce.
EFFICIENCY_BAND = (0.4, 1.05)
# Measured step over the simulator's (measured compute + one all-reduce at the rate measured between the
# steps). Seen: 0.99-1.11 over 5 repeats x 2 placements, load ~1 (a step also copies the gradient in and
# out of its flat buffer and waits for the other rank's compute); 0.88 once in CI while the link was still
# priced before the steps, under other load. The band keeps ~0.1 below and 0.3 above for heavier load.
MODEL_BAND = (0.9, 1.4)


@dataclass(frozen=True)
class ProbeJobSize:
    """The placed job: an MLP ``features`` -> ``hidden`` -> ``features``, ``steps`` steps of ``batch_size``."""

    features: int
    hidden: int
    batch_size: int
    steps: int

    def __post_init__(self) -> None:
        require_at_least(self, 1, "features", "hidden", "batch_size", "steps")


# An MLP of 512 -> 1024 -> 512: 1,050,112 parameters, a 4.2 MB fp32 gradient.
SIZE = ProbeJobSize(features=512, hidden=1024, batch_size=32, steps=8)


@dataclass(frozen=True)
class PlacedJob:
    """A job's ranks on chosen nodes of an open fabric: rank r on ``nodes[r]``.

    ``launch(fn, len(nodes), fabric=PlacedJob(fab, nodes))`` starts it: the launcher
    asks a fabric only for ``topology.world_size`` and ``rank_env(rank)``.
    ``topology`` is the job's own view, its nodes and the zones they span, so
    :func:`labkit.topology.link_bytes_model` prices its ring. gloo's ring runs in
    rank order, so ranks go zone by zone, the same number in each zone.
    """

    fab: fabric.Fabric
    nodes: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.fab.topology.ranks_per_node != 1:
            raise ValueError(
                f"a placed job needs a fabric with ranks_per_node=1, got {self.fab.topology.ranks_per_node}")
        if len(set(self.nodes)) != len(self.nodes) or not all(0 <= n < self.fab.topology.nodes for n in self.nodes):
            raise ValueError(
                f"nodes must be distinct nodes of the fabric (0-{self.fab.topology.nodes - 1}), got {self.nodes}")
        zones = [self.fab.nodes[n].zone for n in self.nodes]
        spanned = list(dict.fromkeys(zones))
        per_zone = len(self.nodes) // len(spanned)
        if zones != [zone for zone in spanned for _ in range(per_zone)]:
            raise ValueError(
                f"nodes {self.nodes} sit in zones {zones}: place ranks zone by zone with the same number "
                "in each zone, e.g. (0, 1, 4, 5) on two zones of four nodes"
            )

    @property
    def zones_spanned(self) -> int:
        return len({self.fab.nodes[n].zone for n in self.nodes})

    @property
    def topology(self) -> Topology:
        spanned = self.zones_spanned
        return Topology(
            nodes=len(self.nodes),
            zones=spanned,
            inter_node_bytes_per_s=self.fab.topology.inter_node_bytes_per_s,
            cross_zone_bytes_per_s=self.fab.topology.cross_zone_bytes_per_s if spanned > 1 else None,
        )

    @property
    def scope(self) -> str:
        """The simulator's name for what the job spans (one fabric is one cluster)."""
        return "cluster" if self.zones_spanned > 1 else "zone"

    def keep_frames_in_zone(self) -> None:
        """Stop the fabric's bridges from flooding this job's frames, and their own, into other zones.

        Real zones are joined by routers, which forward neither broadcasts nor frames
        for addresses they have not seen. The fabric's zones are one Ethernet segment
        of bridges, which flood both into every zone. So each node of the job learns
        its peers' Ethernet addresses (no ARP broadcasts), each switch learns the job's
        nodes on its ports (no flooded first frames), and the switches' bridges lose
        IPv6, which they get despite ``addrgenmode none`` and use for router
        solicitations and MLD reports into every zone. About 1 KB per run otherwise.

        A job inside one zone then waits for the zone links to fall quiet, since it must put no byte on
        them; a job across zones puts megabytes there, beside which the bridges' announcements are lost
        (Lab 8 allows 1%), so it does not wait (about 1.7 s a run).
        """
        nodes = [self.fab.nodes[n] for n in self.nodes]
        macs = {node.index: json.loads(run("ip", "-n", node.netns, "-j", "link", "show", fabric.UPLINK))[0]["address"]
                for node in nodes}
        for node in nodes:
            switch, port = self.fab.links[f"node{node.index}"][1]
            run("bridge", "-n", switch, "fdb", "replace", macs[node.index], "dev", port, "master", "static")
            for peer in nodes:
                if peer is not node:
                    run("ip", "-n", node.netns, "neigh", "replace", peer.address, "lladdr", macs[peer.index],
                        "dev", fabric.UPLINK, "nud", "permanent")
        for switch in [*self.fab.switches, *([self.fab.core] if self.fab.core else [])]:
            run("ip", "netns", "exec", switch, "sysctl", "-qw", "net.ipv6.conf.br0.disable_ipv6=1")
        if self.zones_spanned == 1:
            wait_for_quiet_zone_links(self.fab)

    def rank_env(self, rank: int) -> dict[str, str]:
        node = self.nodes[rank]
        return {**self.fab.rank_env(node), "MASTER_ADDR": self.fab.nodes[self.nodes[0]].address}


def wait_for_quiet_zone_links(fab: fabric.Fabric, quiet_s: float = 1.5, timeout_s: float = 8.0) -> None:
    """Return once no byte has crossed a zone link for ``quiet_s``.

    A bridge that comes up announces itself for a second or two (IGMP and MLD
    reports, IPv6 duplicate-address checks) into every zone; a count started before
    that ends would blame those bytes on the job.
    """
    deadline = time.monotonic() + timeout_s
    last, quiet_since = None, time.monotonic()
    while time.monotonic() < deadline:
        now = {link: counted for link, counted in fab.link_bytes().items() if link.startswith("zone")}
        if now != last:
            last, quiet_since = now, time.monotonic()
        elif time.monotonic() - quiet_since >= quiet_s:
            return
        time.sleep(0.25)


def data_parallel_rank(*, features: int, hidden: int, batch_size: int, steps: int) -> dict[str, Any]:
    """Rank function: ``steps`` data-parallel SGD steps after one warm-up, each followed by the all-reduce alone.

    One flat all-reduce of every gradient per step, as DDP does with one bucket.
    Compute is forward, backward and the optimizer step; the step is everything.
    The lone all-reduce (after a barrier, so no rank waits for another's compute)
    prices the link. It alternates with the steps so both see the same load: timed
    apart, before the steps, it came out 12% slower than the step's own once in CI.
    """
    import torch
    import torch.distributed as dist

    info = rank_info()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, features))
    params = list(model.parameters())
    gradient_bytes = sum(p.numel() for p in params) * 4
    optimizer = torch.optim.SGD(params, lr=0.01)
    generator = torch.Generator().manual_seed(info.rank)
    x = torch.randn(batch_size, features, generator=generator)
    y = torch.randn(batch_size, features, generator=generator)
    compute_s, step_s, allreduce_s = [], [], []
    dist.barrier()
    for step in range(steps + 1):
        start = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        computed = time.perf_counter()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        flat /= info.world_size
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        synced = time.perf_counter()
        optimizer.step()
        end = time.perf_counter()
        dist.barrier()
        alone = time.perf_counter()
        dist.all_reduce(flat)
        reduced = time.perf_counter()
        if step:
            compute_s.append(computed - start + end - synced)
            step_s.append(end - start)
            allreduce_s.append(reduced - alone)
    return {"gradient_bytes": gradient_bytes, "allreduce_times_s": allreduce_s,
            "all_reduce_calls": 2 * (steps + 1), "compute_s": compute_s, "step_s": step_s}


@dataclass(frozen=True)
class PlacementRun:
    """One placement of the job on the fabric, measured."""

    placement: str
    scope: str
    nodes: tuple[int, ...]
    world_size: int
    gradient_bytes: int
    compute_s: float
    step_s: float
    allreduce_s: float
    slowest_link_bytes_per_s: float
    zone_link_bytes: int
    zone_link_model_bytes: int
    load_average: float

    @property
    def effective_bytes_per_s(self) -> float:
        """Ring bytes each rank sent per second of the gradient all-reduce alone."""
        return ring_bytes_per_rank("all_reduce", self.gradient_bytes, self.world_size) / self.allreduce_s

    @property
    def effective_gbps(self) -> float:
        return self.effective_bytes_per_s / GBIT

    @property
    def link_efficiency(self) -> float:
        """Effective bandwidth over the shaped rate of the slowest link the ring crosses."""
        return self.effective_bytes_per_s / self.slowest_link_bytes_per_s

    def describe(self) -> str:
        return (f"{self.placement:>13} (nodes {self.nodes}): step {self.step_s * 1e3:6.1f} ms = compute "
                f"{self.compute_s * 1e3:5.1f} ms + sync; all-reduce alone {self.allreduce_s * 1e3:6.1f} ms = "
                f"{self.effective_gbps:.3f} Gbit/s on a {self.slowest_link_bytes_per_s / GBIT:g} Gbit/s link; "
                f"zone links carried {self.zone_link_bytes / 1e6:.2f} MB (ring model "
                f"{self.zone_link_model_bytes / 1e6:.2f} MB); load {self.load_average:.1f}")


def _slowest_rank_median(results: list[dict[str, Any]], key: str) -> float:
    """Per step (or call) the slowest rank's time, as a synchronous job waits for it; then the median."""
    return statistics.median(max(per_rank) for per_rank in zip(*(result[key] for result in results)))


def measure(fab: fabric.Fabric, placement: str, nodes: Sequence[int], size: ProbeJobSize = SIZE,
            timeout_s: float = 180.0) -> PlacementRun:
    """Run :func:`data_parallel_rank` on ``nodes`` of an open fabric; times and zone-link bytes."""
    job = PlacedJob(fab, tuple(nodes))
    job.keep_frames_in_zone()
    before = fab.link_bytes()
    results = launch(data_parallel_rank, len(job.nodes), fabric=job, timeout_s=timeout_s, **asdict(size))
    traffic = fabric.delta(before, fab.link_bytes())
    gradient_bytes, calls = results[0]["gradient_bytes"], results[0]["all_reduce_calls"]
    per_call = link_bytes_model("all_reduce", gradient_bytes, job.topology)
    busiest = max(per_call, key=lambda link: per_call[link] / job.topology.link_bytes_per_s(link))
    return PlacementRun(
        placement=placement,
        scope=job.scope,
        nodes=job.nodes,
        world_size=len(job.nodes),
        gradient_bytes=gradient_bytes,
        compute_s=_slowest_rank_median(results, "compute_s"),
        step_s=_slowest_rank_median(results, "step_s"),
        allreduce_s=_slowest_rank_median(results, "allreduce_times_s"),
        slowest_link_bytes_per_s=job.topology.link_bytes_per_s(busiest),
        zone_link_bytes=sum(t.tx_payload_bytes for link, t in traffic.items() if link.startswith("zone")),
        zone_link_model_bytes=calls * sum(n for link, n in per_call.items() if link.startswith("zone")),
        load_average=load_average(),
    )


def measure_placements(size: ProbeJobSize = SIZE, topology: Topology = FABRIC,
                       placements: dict[str, tuple[int, ...]] = PLACEMENTS) -> list[PlacementRun]:
    """The same job at each placement, one after the other on one fabric (needs ``probe()`` == namespaces)."""
    with fabric.Fabric(topology) as fab:
        return [measure(fab, name, nodes, size) for name, nodes in placements.items()]


def fleet_links(runs: Sequence[PlacementRun], scale: float = FABRIC_SCALE) -> dict[str, Link]:
    """Links for :mod:`labkit.placement`, per scope: measured where ``runs`` measured it, else assumed.

    ``runs`` must hold one in-zone run and one across-zones run; empty ``runs``
    (an emulated machine) gives the assumed table. ``scale=1`` keeps the fabric's
    own rates, to predict the miniature job itself.
    """
    if not runs:
        return {scope: Link(f"{link.name}, assumed (no fabric here)", link.bandwidth_gbps, link.latency_us)
                for scope, link in DEFAULT_LINKS.items()}
    by_scope = {run.scope: run for run in runs}
    missing = {"zone", "cluster"} - set(by_scope)
    if missing:
        raise ValueError(f"runs must measure the scopes 'zone' and 'cluster', missing {sorted(missing)}: "
                         "place one job inside a zone and one across zones")
    zone_gbps, cluster_gbps = (by_scope[scope].effective_gbps * scale for scope in ("zone", "cluster"))
    table = DEFAULT_LINKS
    return {
        "node": Link(f"intra-node, assumed {NODE_OVER_ZONE:g}x measured in-zone", zone_gbps * NODE_OVER_ZONE,
                     table["node"].latency_us),
        "zone": Link(f"intra-zone, measured on the fabric x{scale:g}", zone_gbps, table["zone"].latency_us),
        "cluster": Link(f"cross-zone, measured on the fabric x{scale:g}", cluster_gbps, table["cluster"].latency_us),
        "fleet": Link(f"cross-cluster, assumed {FLEET_OVER_CLUSTER:g}x measured cross-zone",
                      cluster_gbps * FLEET_OVER_CLUSTER, table["fleet"].latency_us),
    }


def model_step_s(run: PlacementRun, links: dict[str, Link]) -> float:
    """The simulator's step time for the measured job: its measured compute plus a priced all-reduce."""
    job = Job(0, 0.0, run.world_size, 1, run.compute_s, run.gradient_bytes)
    return step_time_s(job, run.scope, links)


def links_text(links: dict[str, Link]) -> str:
    return "\n".join(f"{scope:>8}: {links[scope].bandwidth_gbps:9.2f} Gbit/s  {links[scope].latency_us:6g} us  "
                     f"({links[scope].name})" for scope in SCOPES)
