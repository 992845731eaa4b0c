"""A fleet of clusters, zones and nodes, the jobs it runs, and what a job's placement costs per step.

A job's step time is its compute time plus one gradient all-reduce priced by
Lab 5's alpha-beta ring model (:func:`labkit.collectives.collective_time_s`) over
the *slowest* link its placement crosses: a ring is only as fast as its slowest
hop, so one GPU in another zone slows every step of the whole job. The simulator
that places a stream of these jobs is :mod:`labkit.placement`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from labkit.collectives import Link, collective_time_s

SCOPES = ("node", "zone", "cluster", "fleet")
# The Llama 3 paper's figures (theirs): 419 unexpected interruptions in 54 days on
# 16,384 GPUs, i.e. 2,048 nodes of 8.
LLAMA3_FAILURES_PER_NODE_HOUR = 419 / (54 * 24 * 2048)
DEFAULT_LINKS: dict[str, Link] = {
    "node": Link("intra-node (NVLink class)", bandwidth_gbps=2400.0, latency_us=3.0),
    "zone": Link("intra-zone (400G InfiniBand)", bandwidth_gbps=400.0, latency_us=5.0),
    "cluster": Link("cross-zone (100G Ethernet)", bandwidth_gbps=100.0, latency_us=50.0),
    "fleet": Link("cross-cluster (25G WAN)", bandwidth_gbps=25.0, latency_us=2000.0),
}


@dataclass(frozen=True)
class Fleet:
    """Clusters of zones of nodes. Per-node arrays are indexed by node id.

    Nodes are numbered cluster by cluster, zone by zone, so a zone and a cluster
    are each a contiguous range of node ids.
    """

    gpus_per_node: int
    node_cluster: np.ndarray
    node_zone: np.ndarray
    failures_per_node_hour: np.ndarray
    links: dict[str, Link]

    @property
    def nodes(self) -> int:
        return int(self.node_cluster.size)

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def clusters(self) -> int:
        return int(self.node_cluster.max()) + 1

    @property
    def zones(self) -> int:
        return int(self.node_zone.max()) + 1

    def cluster_gpus(self) -> np.ndarray:
        return np.bincount(self.node_cluster, minlength=self.clusters) * self.gpus_per_node

    def zone_gpus(self) -> np.ndarray:
        return np.bincount(self.node_zone, minlength=self.zones) * self.gpus_per_node

    def describe(self) -> str:
        return (
            f"{self.clusters} clusters, {self.zones} zones, {self.nodes} nodes, "
            f"{self.gpus:,} GPUs ({self.gpus_per_node} per node)"
        )


def build_fleet(
    nodes_per_zone: Sequence[Sequence[int]],
    *,
    gpus_per_node: int = 8,
    failures_per_node_hour: float = LLAMA3_FAILURES_PER_NODE_HOUR,
    failure_rate_spread: float = 1.0,
    links: dict[str, Link] | None = None,
    seed: int = 0,
) -> Fleet:
    """A fleet from ``nodes_per_zone[cluster][zone]``.

    Node failure rates are log-normal around ``failures_per_node_hour`` with
    sigma ``failure_rate_spread``: a few bad nodes fail far more often than the
    median, as fleets report.
    """
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
    if failures_per_node_hour < 0:
        raise ValueError(f"failures_per_node_hour must be >= 0, got {failures_per_node_hour}")
    if failure_rate_spread < 0:
        raise ValueError(f"failure_rate_spread must be >= 0, got {failure_rate_spread}")
    clusters, zones = [], []
    zone_id = 0
    for cluster_id, zone_sizes in enumerate(nodes_per_zone):
        for count in zone_sizes:
            if count < 0:
                raise ValueError(f"nodes_per_zone entries must be >= 0, got {count} in cluster {cluster_id}")
            clusters += [cluster_id] * count
            zones += [zone_id] * count
            zone_id += 1
    if not clusters:
        raise ValueError(
            f"fleet has no capacity: nodes_per_zone={list(map(list, nodes_per_zone))} holds no nodes; "
            "give at least one zone at least one node"
        )
    links = dict(DEFAULT_LINKS if links is None else links)
    missing = [scope for scope in SCOPES if scope not in links]
    if missing:
        raise ValueError(f"links must name every scope {SCOPES}, missing {missing}")
    rng = np.random.default_rng(seed)
    mean_log = np.log(max(failures_per_node_hour, 1e-300)) - failure_rate_spread**2 / 2
    rates = np.exp(rng.normal(mean_log, failure_rate_spread, len(clusters))) if failures_per_node_hour else np.zeros(len(clusters))
    return Fleet(
        gpus_per_node=gpus_per_node,
        node_cluster=np.asarray(clusters, dtype=np.int64),
        node_zone=np.asarray(zones, dtype=np.int64),
        failures_per_node_hour=rates,
        links=links,
    )


def uniform_fleet(clusters: int, zones_per_cluster: int, nodes_per_zone: int, **kwargs) -> Fleet:
    """Every cluster the same shape (``10,000 GPUs = 2 x 5 x 125 nodes x 8``)."""
    for name, value in (("clusters", clusters), ("zones_per_cluster", zones_per_cluster), ("nodes_per_zone", nodes_per_zone)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return build_fleet([[nodes_per_zone] * zones_per_cluster] * clusters, **kwargs)


@dataclass(frozen=True)
class Job:
    """A training job: how many GPUs, how many steps, and how chatty each step is."""

    job_id: int
    arrival_s: float
    gpus: int
    steps: int
    compute_s_per_step: float
    gradient_bytes: int
    profile: str = "custom"


COMM_PROFILES = {
    "compute-heavy": {"compute_s_per_step": 1.0, "gradient_bytes": 200_000_000},
    "comm-heavy": {"compute_s_per_step": 0.3, "gradient_bytes": 4_000_000_000},
}


def generate_jobs(
    n_jobs: int,
    *,
    seed: int = 0,
    mean_interarrival_s: float = 300.0,
    sizes_gpus: Sequence[int] = (8, 16, 32, 64, 128, 256, 512),
    size_weights: Sequence[float] | None = None,
    comm_heavy_fraction: float = 0.5,
    mean_steps: int = 20_000,
) -> list[Job]:
    """A Poisson stream of jobs with sizes and communication profiles drawn from ``seed``."""
    if n_jobs < 1:
        raise ValueError(f"n_jobs must be >= 1, got {n_jobs}")
    if mean_interarrival_s <= 0:
        raise ValueError(f"mean_interarrival_s must be > 0, got {mean_interarrival_s}")
    if not 0 <= comm_heavy_fraction <= 1:
        raise ValueError(f"comm_heavy_fraction must be in [0, 1], got {comm_heavy_fraction}")
    if not sizes_gpus or min(sizes_gpus) < 1:
        raise ValueError(f"sizes_gpus must be non-empty with every size >= 1, got {list(sizes_gpus)}")
    if mean_steps < 1:
        raise ValueError(f"mean_steps must be >= 1, got {mean_steps}")
    rng = np.random.default_rng(seed)
    weights = np.asarray(size_weights if size_weights is not None else [1.0] * len(sizes_gpus), dtype=float)
    arrivals = np.cumsum(rng.exponential(mean_interarrival_s, n_jobs))
    sizes = rng.choice(np.asarray(sizes_gpus), size=n_jobs, p=weights / weights.sum())
    heavy = rng.random(n_jobs) < comm_heavy_fraction
    steps = np.maximum(1, rng.exponential(mean_steps, n_jobs).astype(int))
    jobs = []
    for i in range(n_jobs):
        name = "comm-heavy" if heavy[i] else "compute-heavy"
        jobs.append(Job(i, float(arrivals[i]), int(sizes[i]), int(steps[i]), profile=name, **COMM_PROFILES[name]))
    return jobs


def step_time_s(job: Job, scope: str, links: dict[str, Link]) -> float:
    """Compute plus one ring all-reduce of the gradients over the slowest link crossed."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    comm_s = collective_time_s("all_reduce", job.gradient_bytes, job.gpus, links[scope]) if job.gpus > 1 else 0.0
    return job.compute_s_per_step + comm_s


def step_time_text(links: dict[str, Link], gpus: int, gradient_gb: float, compute_s: float) -> str:
    """One line per placement scope: a job's step time when its ranks span that scope."""
    job = Job(0, 0.0, gpus, 1, compute_s, int(gradient_gb * 1e9))
    return "\n".join(f"{scope:>8}: {step_time_s(job, scope, links):7.3f} s per step  ({links[scope].name})"
                     for scope in SCOPES)


def step_time_widget(links: dict[str, Link]):
    """Controls over :func:`step_time_text` (see :mod:`labkit.widgets`)."""
    import ipywidgets as widgets

    from labkit.widgets import live

    controls = {
        "gpus": widgets.IntSlider(value=64, min=8, max=512, step=8, description="GPUs"),
        "gradient_gb": widgets.FloatSlider(value=4.0, min=0.1, max=20, description="gradient GB"),
        "compute_s": widgets.FloatSlider(value=0.3, min=0.05, max=3, description="compute s"),
    }
    return live(lambda **values: step_time_text(links, **values), controls)
