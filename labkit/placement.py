"""A fleet placement simulator: where a job lands decides how fast it runs.

This is a **simulator**, not a scheduler. It takes a fleet of clusters, each
split into zones of nodes with GPUs (:mod:`labkit.fleet_model`), and replays a stream
of training jobs through one placement policy. A job's step time depends on the
slowest link its placement crosses (:func:`labkit.fleet_model.step_time_s`), so one GPU
in another zone slows every step of the whole job.

Khanna (Adobe) describes keeping each job inside one cluster and preferably one
zone while the fleet spans clusters; the simulator lets us see why and what it
costs (jobs wait longer for a zone with room). Failures are drawn per node from
a failure rate; a job that loses a node loses the work since its last
checkpoint and waits for a replacement, which is fast when spares are held
back. Everything is deterministic given the seed.

Simplifications, stated so nobody mistakes them for measurements: compute time
per step does not depend on placement; failed nodes are replaced at once (the
wait is the job's, not the fleet's); links are not shared between jobs.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from labkit.fleet_model import Fleet, Job, step_time_s

POLICIES = ("first-fit-anywhere", "pack-in-one-cluster", "pack-in-one-zone", "with-spares-held-back")


@dataclass
class _FreeGpus:
    """Free GPUs per node, with per-zone and per-cluster totals kept in step."""

    fleet: Fleet
    usable: np.ndarray
    free: np.ndarray = field(init=False)
    zone_free: np.ndarray = field(init=False)
    cluster_free: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.free = np.where(self.usable, self.fleet.gpus_per_node, 0).astype(np.int64)
        self.zone_free = np.bincount(self.fleet.node_zone, weights=self.free, minlength=self.fleet.zones).astype(np.int64)
        self.cluster_free = np.bincount(self.fleet.node_cluster, weights=self.free, minlength=self.fleet.clusters).astype(np.int64)
        self.zone_start = np.searchsorted(self.fleet.node_zone, np.arange(self.fleet.zones))
        self.zone_end = np.searchsorted(self.fleet.node_zone, np.arange(self.fleet.zones), side="right")
        self.cluster_start = np.searchsorted(self.fleet.node_cluster, np.arange(self.fleet.clusters))
        self.cluster_end = np.searchsorted(self.fleet.node_cluster, np.arange(self.fleet.clusters), side="right")
        self.total = int(self.free.sum())

    def take(self, start: int, end: int, gpus: int) -> tuple[np.ndarray, np.ndarray]:
        """First fit over nodes ``start:end``, fullest-fitting node first for small jobs."""
        window = self.free[start:end]
        if gpus <= self.fleet.gpus_per_node:
            fits = np.flatnonzero(window >= gpus)
            if fits.size:
                best = fits[np.argmin(window[fits])]
                nodes, counts = np.array([start + best]), np.array([gpus])
                self._apply(nodes, counts, -1)
                return nodes, counts
        candidates = np.flatnonzero(window)
        cumulative = np.cumsum(window[candidates])
        last = int(np.searchsorted(cumulative, gpus))
        nodes = start + candidates[: last + 1]
        counts = window[candidates[: last + 1]].copy()
        counts[-1] -= cumulative[last] - gpus
        self._apply(nodes, counts, -1)
        return nodes, counts

    def release(self, nodes: np.ndarray, counts: np.ndarray) -> None:
        self._apply(nodes, counts, +1)

    def _apply(self, nodes: np.ndarray, counts: np.ndarray, sign: int) -> None:
        self.free[nodes] += sign * counts
        np.add.at(self.zone_free, self.fleet.node_zone[nodes], sign * counts)
        np.add.at(self.cluster_free, self.fleet.node_cluster[nodes], sign * counts)
        self.total += sign * int(counts.sum())


def _best_fit(free_per_group: np.ndarray, gpus: int) -> int | None:
    """The group with the least free room that still fits (keeps big holes for big jobs)."""
    fits = np.flatnonzero(free_per_group >= gpus)
    if not fits.size:
        return None
    return int(fits[np.argmin(free_per_group[fits])])


def _place(state: _FreeGpus, policy: str, gpus: int, zone_capacity_gpus: int) -> tuple[np.ndarray, np.ndarray] | None:
    if gpus > state.total:
        return None
    if policy == "first-fit-anywhere":
        return state.take(0, state.fleet.nodes, gpus)
    if policy in ("pack-in-one-zone", "with-spares-held-back") and gpus <= zone_capacity_gpus:
        zone = _best_fit(state.zone_free, gpus)
        return None if zone is None else state.take(state.zone_start[zone], state.zone_end[zone], gpus)
    cluster = _best_fit(state.cluster_free, gpus)
    return None if cluster is None else state.take(state.cluster_start[cluster], state.cluster_end[cluster], gpus)


def _scope(fleet: Fleet, nodes: np.ndarray) -> str:
    if nodes.size == 1:
        return "node"
    if fleet.node_zone[nodes[0]] == fleet.node_zone[nodes[-1]]:
        return "zone"
    if fleet.node_cluster[nodes[0]] == fleet.node_cluster[nodes[-1]]:
        return "cluster"
    return "fleet"


@dataclass(frozen=True)
class RecoveryCosts:
    """What one node failure costs a running job (simulation inputs, not measurements)."""

    checkpoint_interval_s: float = 1800.0
    spare_swap_s: float = 300.0
    replacement_wait_s: float = 4 * 3600.0


@dataclass(frozen=True)
class PolicySummary:
    """The fleet-level figures of one policy's run, the ones the lab compares across policies."""

    policy: str
    mean_completion_h: float
    comm_heavy_completion_h: float
    mean_queue_delay_h: float
    utilisation: float
    jobs_per_day: float
    jobs_spanning_zones: int
    jobs_spanning_clusters: int
    failures: int

    def describe(self) -> str:
        """One line, rounded to what a simulator's figures are worth."""
        return (f"{self.policy}: completion {self.mean_completion_h:.3f} h (comm-heavy "
                f"{self.comm_heavy_completion_h:.3f} h), queueing {self.mean_queue_delay_h:.3f} h, "
                f"utilisation {self.utilisation:.3f}, {self.jobs_per_day:.1f} jobs/day, "
                f"{self.jobs_spanning_zones} jobs across zones, {self.jobs_spanning_clusters} across clusters, "
                f"{self.failures} failures")


@dataclass(frozen=True)
class SimulationResult:
    """Per-job outcomes of one policy, plus the fleet-level figures."""

    policy: str
    arrival_s: np.ndarray
    start_s: np.ndarray
    finish_s: np.ndarray
    gpus: np.ndarray
    scope: np.ndarray
    failures: np.ndarray
    profile: np.ndarray
    fleet_gpus: int

    @property
    def queue_delay_s(self) -> np.ndarray:
        return self.start_s - self.arrival_s

    @property
    def completion_s(self) -> np.ndarray:
        """Job completion time: arrival to finish (queueing plus running)."""
        return self.finish_s - self.arrival_s

    @property
    def makespan_s(self) -> float:
        return float(self.finish_s.max() - self.arrival_s.min())

    @property
    def utilisation(self) -> float:
        """Busy GPU-seconds over all GPU-seconds of the run (held-back spares count as idle)."""
        busy = float(np.sum(self.gpus * (self.finish_s - self.start_s)))
        return busy / (self.fleet_gpus * self.makespan_s)

    @property
    def jobs_per_day(self) -> float:
        return self.finish_s.size / (self.makespan_s / 86_400)

    def mean_completion_h(self, profile: str | None = None) -> float:
        mask = np.ones(self.finish_s.size, bool) if profile is None else self.profile == profile
        return float(self.completion_s[mask].mean() / 3600)

    def summary(self) -> PolicySummary:
        return PolicySummary(
            policy=self.policy,
            mean_completion_h=self.mean_completion_h(),
            comm_heavy_completion_h=self.mean_completion_h("comm-heavy"),
            mean_queue_delay_h=float(self.queue_delay_s.mean() / 3600),
            utilisation=self.utilisation,
            jobs_per_day=self.jobs_per_day,
            jobs_spanning_zones=int(np.isin(self.scope, ["cluster", "fleet"]).sum()),
            jobs_spanning_clusters=int((self.scope == "fleet").sum()),
            failures=int(self.failures.sum()),
        )


def _validate_jobs(fleet: Fleet, jobs: Sequence[Job], usable_gpus_per_cluster: np.ndarray) -> None:
    if not jobs:
        raise ValueError("jobs must hold at least one job, got none")
    largest = int(usable_gpus_per_cluster.max())
    for job in jobs:
        if job.gpus < 1:
            raise ValueError(f"job {job.job_id}: gpus must be >= 1, got {job.gpus}")
        if job.gpus > largest:
            raise ValueError(
                f"job {job.job_id} needs {job.gpus} GPUs but the largest cluster offers {largest} "
                "(after spares are held back); a job must fit in one cluster: split it or grow a cluster"
            )


def simulate(
    fleet: Fleet,
    jobs: Sequence[Job],
    policy: str,
    *,
    seed: int = 0,
    spare_nodes_per_cluster: int = 2,
    recovery: RecoveryCosts = RecoveryCosts(),
) -> SimulationResult:
    """Replay ``jobs`` through ``policy``; event-driven (a heap of completions), FIFO with backfill.

    Queued jobs start in arrival order as soon as they fit; a job that does not
    fit yet does not block smaller ones behind it. Failures: each running job
    draws its failures from the summed rates of its nodes, with a generator
    seeded by ``(seed, job_id)`` so every policy sees the same luck per job.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if spare_nodes_per_cluster < 0:
        raise ValueError(f"spare_nodes_per_cluster must be >= 0, got {spare_nodes_per_cluster}")
    holds_spares = policy == "with-spares-held-back"
    usable = _usable_nodes(fleet, spare_nodes_per_cluster if holds_spares else 0)
    state = _FreeGpus(fleet, usable)
    usable_per_cluster = np.bincount(fleet.node_cluster, weights=usable, minlength=fleet.clusters) * fleet.gpus_per_node
    if usable_per_cluster.max() <= 0:
        raise ValueError(
            f"fleet has no capacity left for jobs: spare_nodes_per_cluster={spare_nodes_per_cluster} "
            "holds back every node; lower it"
        )
    _validate_jobs(fleet, jobs, usable_per_cluster)
    zone_capacity = int((np.bincount(fleet.node_zone, weights=usable, minlength=fleet.zones) * fleet.gpus_per_node).max())
    replay = _Replay(fleet, jobs, policy, state, zone_capacity, seed, recovery.checkpoint_interval_s,
                     recovery.spare_swap_s if holds_spares else recovery.replacement_wait_s)
    replay.run()
    return replay.result()


def _usable_nodes(fleet: Fleet, spare_nodes_per_cluster: int) -> np.ndarray:
    """Which nodes may take jobs: all but the last ``spare_nodes_per_cluster`` of each cluster, kept for swaps."""
    usable = np.ones(fleet.nodes, dtype=bool)
    if spare_nodes_per_cluster:
        for cluster in range(fleet.clusters):
            members = np.flatnonzero(fleet.node_cluster == cluster)
            usable[members[len(members) - spare_nodes_per_cluster:]] = False
    return usable


@dataclass
class _Replay:
    """The event loop of :func:`simulate`: a FIFO queue per job size, a heap of running jobs' finish times.

    One queue per size, because backfill only ever needs each size's oldest job:
    if it does not fit, no younger job of that size does either.
    """

    fleet: Fleet
    jobs: Sequence[Job]
    policy: str
    state: _FreeGpus
    zone_capacity: int
    seed: int
    checkpoint_interval_s: float
    recovery_wait_s: float
    now: float = 0.0
    queues: dict[int, deque[int]] = field(default_factory=dict)
    running: list[tuple[float, int]] = field(default_factory=list)
    allocations: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.jobs)
        self.start, self.finish = np.zeros(n), np.zeros(n)
        self.scopes = np.empty(n, dtype=object)
        self.failures = np.zeros(n, dtype=np.int64)

    def run(self) -> None:
        """Advance to the next event (a finish before an arrival at the same time) and start what fits."""
        jobs, n = self.jobs, len(self.jobs)
        order = sorted(range(n), key=lambda i: (jobs[i].arrival_s, i))
        next_arrival = 0
        while next_arrival < n or self.running:
            arrival_t = jobs[order[next_arrival]].arrival_s if next_arrival < n else np.inf
            if self.running and self.running[0][0] <= arrival_t:
                self.now, i = heapq.heappop(self.running)
                self.state.release(*self.allocations.pop(i))
            else:
                self.now = arrival_t
                i = order[next_arrival]
                self.queues.setdefault(jobs[i].gpus, deque()).append(i)
                next_arrival += 1
            self.schedule()

    def schedule(self) -> None:
        """Start queued jobs, oldest first, until no queue's head fits (backfill: a big job does not block)."""
        while self.queues:
            heads = sorted((queue[0], size) for size, queue in self.queues.items())
            for i, size in heads:
                placement = _place(self.state, self.policy, size, self.zone_capacity)
                if placement is not None:
                    self.queues[size].popleft()
                    if not self.queues[size]:
                        del self.queues[size]
                    self.start_job(i, placement)
                    break
            else:
                return

    def start_job(self, i: int, placement: tuple[np.ndarray, np.ndarray]) -> None:
        """Run job ``i`` on ``placement``: its step time follows its scope, its failures its nodes' rates."""
        job = self.jobs[i]
        nodes = placement[0]
        scope = _scope(self.fleet, nodes)
        run_s = job.steps * step_time_s(job, scope, self.fleet.links)
        rng = np.random.default_rng((self.seed, job.job_id))
        rate_per_s = self.fleet.failures_per_node_hour[nodes].sum() / 3600
        count = int(rng.poisson(rate_per_s * run_s))
        lost_s = float(rng.uniform(0, min(self.checkpoint_interval_s, run_s), count).sum())
        self.start[i], self.scopes[i], self.failures[i] = self.now, scope, count
        self.finish[i] = self.now + run_s + lost_s + count * self.recovery_wait_s
        self.allocations[i] = placement
        heapq.heappush(self.running, (self.finish[i], i))

    def result(self) -> SimulationResult:
        jobs = self.jobs
        return SimulationResult(
            policy=self.policy,
            arrival_s=np.array([job.arrival_s for job in jobs]),
            start_s=self.start,
            finish_s=self.finish,
            gpus=np.array([job.gpus for job in jobs]),
            scope=self.scopes.astype(str),
            failures=self.failures,
            profile=np.array([job.profile for job in jobs]),
            fleet_gpus=self.fleet.gpus,
        )


def compare_policies(
    fleet: Fleet, jobs: Sequence[Job], policies: Sequence[str] = POLICIES, **kwargs
) -> dict[str, SimulationResult]:
    """The same fleet and job stream under each policy."""
    return {policy: simulate(fleet, jobs, policy, **kwargs) for policy in policies}


def plot_policies(results: dict[str, SimulationResult]):
    """Four panels: completion time (all / comm-heavy), queueing delay, utilisation, jobs per day."""
    from labkit import plots

    fig, axes = plots.figure(4, width=15, height=3.8)
    labels = list(results)
    colors = [plots.BASELINE if name == "first-fit-anywhere" else plots.FIX for name in labels]
    summaries = [results[name].summary() for name in labels]
    plots.bars(axes[0], labels, [s.comm_heavy_completion_h for s in summaries], colors=colors,
               fmt="{:.1f}", ylabel="hours", title="comm-heavy job completion time")
    plots.bars(axes[1], labels, [s.mean_queue_delay_h for s in summaries], colors=colors,
               fmt="{:.2f}", ylabel="hours", title="mean queueing delay")
    plots.bars(axes[2], labels, [s.utilisation for s in summaries], colors=colors,
               fmt="{:.2f}", ylabel="fraction", title="fleet utilisation")
    plots.bars(axes[3], labels, [s.jobs_per_day for s in summaries], colors=colors,
               fmt="{:.0f}", ylabel="jobs/day", title="completed jobs per day")
    fig.suptitle("Fleet placement simulator (simulated, not measured)")
    fig.tight_layout()
    return fig
