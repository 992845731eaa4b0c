"""Lab 8: the fleet placement simulator -- keep a job in one zone and it finishes sooner -- and its links measured."""

from __future__ import annotations

import time

import numpy as np
import pytest

from labkit import fabric
from labkit import fleet_model
from labkit import placement as pl
from labkit import placement_probe as pp
from labkit.collectives import collective_time_s
from labkit.topology import GBIT, Topology


@pytest.fixture(scope="module")
def fleet() -> fleet_model.Fleet:
    return fleet_model.uniform_fleet(2, 4, 16, seed=1)


@pytest.fixture(scope="module")
def jobs(fleet) -> list[fleet_model.Job]:
    return fleet_model.generate_jobs(200, seed=3, mean_interarrival_s=240, sizes_gpus=(8, 16, 32, 64, 128))


def test_fleet_shape_and_capacity(fleet):
    assert fleet.gpus == 2 * 4 * 16 * 8
    assert fleet.clusters == 2 and fleet.zones == 8
    assert list(fleet.cluster_gpus()) == [512, 512]
    assert np.all(np.diff(fleet.node_zone) >= 0), "zones are contiguous node ranges"


def test_step_time_uses_the_slowest_link_crossed(jobs, fleet):
    job = next(j for j in jobs if j.profile == "comm-heavy" and j.gpus >= 16)
    times = [fleet_model.step_time_s(job, scope, fleet.links) for scope in fleet_model.SCOPES]
    assert times == sorted(times) and times[0] < times[-1]
    expected = job.compute_s_per_step + collective_time_s("all_reduce", job.gradient_bytes, job.gpus, fleet.links["zone"])
    assert fleet_model.step_time_s(job, "zone", fleet.links) == pytest.approx(expected)


def test_zone_packing_never_spans_zones_and_first_fit_does(fleet, jobs):
    zone = pl.simulate(fleet, jobs, "pack-in-one-zone", seed=0)
    anywhere = pl.simulate(fleet, jobs, "first-fit-anywhere", seed=0)
    cluster = pl.simulate(fleet, jobs, "pack-in-one-cluster", seed=0)
    assert not np.isin(zone.scope, ["cluster", "fleet"]).any()
    assert not (cluster.scope == "fleet").any()
    assert np.isin(anywhere.scope, ["cluster", "fleet"]).any()


def test_zone_local_placement_finishes_comm_heavy_jobs_sooner(fleet, jobs):
    zone = pl.simulate(fleet, jobs, "pack-in-one-zone", seed=0)
    anywhere = pl.simulate(fleet, jobs, "first-fit-anywhere", seed=0)
    assert zone.mean_completion_h("comm-heavy") < anywhere.mean_completion_h("comm-heavy")


def test_every_job_completes_once_and_never_before_it_arrives(fleet, jobs):
    for policy in pl.POLICIES:
        result = pl.simulate(fleet, jobs, policy, seed=0)
        assert np.all(result.start_s >= result.arrival_s)
        assert np.all(result.finish_s > result.start_s)
        assert 0 < result.utilisation <= 1


def test_gpus_are_never_oversubscribed(fleet, jobs):
    result = pl.simulate(fleet, jobs, "first-fit-anywhere", seed=0)
    events = sorted([(t, g) for t, g in zip(result.start_s, result.gpus)] +
                    [(t, -g) for t, g in zip(result.finish_s, result.gpus)], key=lambda e: (e[0], e[1]))
    in_use = np.cumsum([g for _, g in events])
    assert in_use.max() <= fleet.gpus


def test_spares_held_back_recover_failures_faster():
    fleet = fleet_model.uniform_fleet(1, 2, 16, failures_per_node_hour=0.01, seed=2)
    jobs = fleet_model.generate_jobs(60, seed=5, mean_interarrival_s=3000, sizes_gpus=(8, 16, 32))
    spares = pl.simulate(fleet, jobs, "with-spares-held-back", seed=1)
    zone = pl.simulate(fleet, jobs, "pack-in-one-zone", seed=1)
    assert spares.failures.sum() > 0
    busy = spares.failures > 0
    per_failure_spares = (spares.finish_s - spares.start_s)[busy].sum() / spares.failures.sum()
    per_failure_zone = (zone.finish_s - zone.start_s)[zone.failures > 0].sum() / max(zone.failures.sum(), 1)
    assert per_failure_spares < per_failure_zone


def test_simulation_is_deterministic_given_a_seed(fleet, jobs):
    a = pl.simulate(fleet, jobs, "with-spares-held-back", seed=7)
    b = pl.simulate(fleet, jobs, "with-spares-held-back", seed=7)
    assert np.array_equal(a.finish_s, b.finish_s) and a.summary() == b.summary()
    assert fleet_model.generate_jobs(50, seed=1) == fleet_model.generate_jobs(50, seed=1)


def test_ten_thousand_gpus_and_a_thousand_jobs_in_five_seconds():
    fleet = fleet_model.uniform_fleet(2, 5, 125)
    jobs = fleet_model.generate_jobs(1000, seed=1)
    assert fleet.gpus == 10_000
    start = time.perf_counter()
    result = pl.simulate(fleet, jobs, "pack-in-one-zone", seed=1)
    elapsed_s = time.perf_counter() - start
    assert result.finish_s.size == 1000
    assert elapsed_s <= 5.0, f"simulation took {elapsed_s:.1f}s"


def test_fleet_with_no_capacity_is_refused():
    with pytest.raises(ValueError, match="no capacity"):
        fleet_model.build_fleet([[0, 0], []])
    with pytest.raises(ValueError, match="gpus_per_node must be >= 1"):
        fleet_model.uniform_fleet(1, 1, 4, gpus_per_node=0)
    tiny = fleet_model.uniform_fleet(1, 1, 2)
    with pytest.raises(ValueError, match="no capacity left"):
        pl.simulate(tiny, fleet_model.generate_jobs(3, sizes_gpus=(8,)), "with-spares-held-back", spare_nodes_per_cluster=2)


def test_job_larger_than_any_cluster_is_refused(fleet):
    too_big = [fleet_model.Job(0, 0.0, 1024, 10, 1.0, 1000)]
    with pytest.raises(ValueError, match="job 0 needs 1024 GPUs but the largest cluster offers 512"):
        pl.simulate(fleet, too_big, "first-fit-anywhere")


def test_bad_policy_and_arguments_name_the_valid_range(fleet, jobs):
    with pytest.raises(ValueError, match="policy must be one of"):
        pl.simulate(fleet, jobs, "random")
    with pytest.raises(ValueError, match="n_jobs must be >= 1, got 0"):
        fleet_model.generate_jobs(0)
    with pytest.raises(ValueError, match=r"comm_heavy_fraction must be in \[0, 1\]"):
        fleet_model.generate_jobs(5, comm_heavy_fraction=2)


# Placement measured on a fabric: labkit.placement_probe


def _run(placement: str, scope: str, allreduce_s: float, compute_s: float = 0.01) -> pp.PlacementRun:
    gradient_bytes = 4 * 2**20
    return pp.PlacementRun(placement, scope, (0, 1), 2, gradient_bytes, compute_s, compute_s + allreduce_s,
                           allreduce_s, GBIT, 0, 0, 0.0)


def test_a_placed_job_runs_rank_r_on_its_node_and_finds_rank_zero_on_its_first_node():
    fab = fabric.Fabric(pp.FABRIC)
    across = pp.PlacedJob(fab, (0, 2))
    assert across.rank_env(1)["LABKIT_NETNS"] == fab.nodes[2].netns
    assert across.rank_env(1)["MASTER_ADDR"] == fab.nodes[0].address
    assert (across.scope, across.topology.zones, across.topology.world_size) == ("cluster", 2, 2)
    assert pp.PlacedJob(fab, (2, 3)).rank_env(0)["MASTER_ADDR"] == fab.nodes[2].address
    assert pp.PlacedJob(fab, (2, 3)).scope == "zone"


def test_a_placement_gloos_ring_cannot_follow_is_refused_with_the_fix():
    fab = fabric.Fabric(Topology(nodes=8, zones=2, inter_node_bytes_per_s=GBIT, cross_zone_bytes_per_s=GBIT))
    with pytest.raises(ValueError, match=r"place ranks zone by zone with the same number in each zone"):
        pp.PlacedJob(fab, (0, 4, 1, 5))
    with pytest.raises(ValueError, match="distinct nodes of the fabric"):
        pp.PlacedJob(fab, (0, 0))


def test_the_simulator_prices_a_measured_job_at_its_compute_plus_its_measured_all_reduce():
    runs = [_run("in one zone", "zone", 0.04), _run("across zones", "cluster", 0.16)]
    on_fabric = pp.fleet_links(runs, scale=1)
    for run in runs:
        latency_s = collective_time_s("all_reduce", 0, 2, on_fabric[run.scope])
        assert pp.model_step_s(run, on_fabric) == pytest.approx(run.compute_s + run.allreduce_s + latency_s)


def test_measured_links_replace_the_zone_and_cluster_rates_and_name_the_assumed_scopes():
    runs = [_run("in one zone", "zone", 0.04), _run("across zones", "cluster", 0.16)]
    links = pp.fleet_links(runs)
    assert links["zone"].bandwidth_gbps == pytest.approx(runs[0].effective_gbps * pp.FABRIC_SCALE)
    assert links["cluster"].bandwidth_gbps == pytest.approx(runs[1].effective_gbps * pp.FABRIC_SCALE)
    assert "measured" in links["zone"].name and "measured" in links["cluster"].name
    assert "assumed" in links["node"].name and "assumed" in links["fleet"].name
    fleet = fleet_model.uniform_fleet(1, 2, 4, links=links)
    assert fleet_model.step_time_text(fleet.links, 64, 4.0, 0.3).count("\n") == len(fleet_model.SCOPES) - 1
    with pytest.raises(ValueError, match="missing \\['cluster'\\]"):
        pp.fleet_links(runs[:1])


def test_without_a_fabric_the_simulator_keeps_the_assumed_table_and_says_so():
    links = pp.fleet_links([])
    assert {scope: link.bandwidth_gbps for scope, link in links.items()} == {
        scope: link.bandwidth_gbps for scope, link in fleet_model.DEFAULT_LINKS.items()}
    assert all("assumed" in link.name for link in links.values())


@pytest.mark.parametrize("measured", [True, False], ids=["measured links", "assumed table"])
def test_links_get_slower_as_a_job_spreads(measured):
    """Node > zone > cluster > fleet, whether the zone and cluster rates were measured or assumed."""
    runs = [_run("in one zone", "zone", 0.04), _run("across zones", "cluster", 0.16)] if measured else []
    links = pp.fleet_links(runs)
    bandwidths = [links[scope].bandwidth_gbps for scope in fleet_model.SCOPES]
    assert bandwidths == sorted(bandwidths, reverse=True)
