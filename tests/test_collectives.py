"""The ring cost model, the collective counter and the link emulation."""

import pytest

from labkit import collective_bench
from labkit import collectives as c
from labkit.collectives import LINKS, Link, collective_time_s, ring_bytes_per_rank


def test_links_include_the_story_links():
    for name in ("1 Gbps", "4 Gbps Ethernet", "100 Gbps", "NVLink-class"):
        assert LINKS[name].bandwidth_gbps > 0


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_all_reduce_sends_twice_what_all_gather_sends(world_size):
    message_bytes = 4 * 1024 * world_size
    all_reduce = ring_bytes_per_rank("all_reduce", message_bytes, world_size)
    assert all_reduce == 2 * (world_size - 1) * message_bytes // world_size
    assert all_reduce == 2 * ring_bytes_per_rank("all_gather", message_bytes, world_size)
    assert ring_bytes_per_rank("reduce_scatter", message_bytes, world_size) == (world_size - 1) * message_bytes // world_size
    assert ring_bytes_per_rank("all_to_all", message_bytes, world_size) == (world_size - 1) * message_bytes // world_size


def test_all_reduce_bytes_approach_twice_the_message_as_ranks_grow():
    message_bytes = 2**30
    ratios = [ring_bytes_per_rank("all_reduce", message_bytes, n) / message_bytes for n in (2, 8, 64, 1024)]
    assert ratios == sorted(ratios)
    assert 1.99 < ratios[-1] < 2.0


def test_one_rank_sends_nothing_and_waits_for_nothing():
    for op in c.OPS:
        assert ring_bytes_per_rank(op, 10**6, 1) == 0
        assert collective_time_s(op, 10**6, 1, LINKS["1 Gbps"]) == 0.0


def test_collective_time_is_latency_per_step_plus_bytes_over_bandwidth():
    link = Link("test", bandwidth_gbps=8.0, latency_us=10.0)
    seconds = collective_time_s("all_reduce", 10**9, 4, link)
    assert seconds == pytest.approx(6 * 10e-6 + 1.5e9 / 1e9)


def test_slower_link_takes_proportionally_longer_for_large_messages():
    slow = collective_time_s("all_reduce", 10**9, 8, LINKS["4 Gbps Ethernet"])
    fast = collective_time_s("all_reduce", 10**9, 8, LINKS["100 Gbps"])
    assert slow / fast == pytest.approx(25, rel=0.01)


def test_bert_large_gradients_on_64_ranks_send_twice_63_64ths_and_take_over_20x_longer_over_4_gbps():
    """Lab 5's opening numbers: one fp32 all-reduce of BERT-Large's 340M gradients on 64 ranks."""
    message = 340_000_000 * 4
    sent = ring_bytes_per_rank("all_reduce", message, 64)
    assert sent == 2 * 63 * message // 64
    assert ring_bytes_per_rank("all_gather", message, 64) * 2 == sent
    slow, fast = (collective_time_s("all_reduce", message, 64, LINKS[n]) for n in ("4 Gbps Ethernet", "100 Gbps"))
    assert slow > 20 * fast


def test_bus_bandwidth_factors_follow_nccl_tests():
    assert c.bus_bandwidth_factor("all_reduce", 4) == 1.5
    assert c.bus_bandwidth_factor("all_gather", 4) == 0.75
    assert c.bus_bandwidth_factor("reduce_scatter", 4) == 0.75
    algbw, busbw = collective_bench.bandwidths_gbytes_per_s("all_reduce", 2 * 10**9, 4, 1.0)
    assert (algbw, busbw) == (2.0, 3.0)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: Link("x", bandwidth_gbps=0, latency_us=1), "bandwidth_gbps must be > 0"),
        (lambda: Link("x", bandwidth_gbps=-1, latency_us=1), "bandwidth_gbps must be > 0"),
        (lambda: Link("x", bandwidth_gbps=1, latency_us=-1), "latency_us must be >= 0"),
        (lambda: ring_bytes_per_rank("all_reduce", 100, 0), "world_size must be >= 1"),
        (lambda: ring_bytes_per_rank("all_reduce", -1, 2), "message_bytes must be >= 0"),
        (lambda: ring_bytes_per_rank("allreduce", 100, 2), "op must be one of"),
        (lambda: collective_bench.bandwidths_gbytes_per_s("all_reduce", 100, 2, 0.0), "time_s must be > 0"),
        (lambda: collective_bench.run_benchmark(1), "world_size must be >= 2"),
    ],
)
def test_bad_input_names_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.slow
@pytest.mark.parametrize("world_size, async_op", [(2, False), (4, True)])
def test_counted_bytes_equal_the_ring_model_and_the_emulation_sleeps_the_modelled_time(world_size, async_op):
    from labkit.launcher import launch

    numel, repeats, link = 3000, 2, LINKS["1 Gbps"]
    results = launch(
        collective_bench.count_collectives_rank, world_size, numel_per_rank=numel, ops=c.OPS, repeats=repeats,
        link_name=link.name, async_op=async_op,
    )
    expected_s = 0.0
    for op in c.OPS:
        expected_s += repeats * collective_time_s(op, collective_bench.expected_message_bytes(op, numel, world_size), world_size, link)
    for result in results:
        assert result["wrappers_removed"]
        for op in c.OPS:
            message_bytes = collective_bench.expected_message_bytes(op, numel, world_size)
            count = result["counts"][op]
            assert count["calls"] == repeats
            assert count["message_bytes"] == repeats * message_bytes
            assert count["ring_bytes"] == repeats * ring_bytes_per_rank(op, message_bytes, world_size)
        assert result["emulated_s"] == pytest.approx(expected_s)
        assert result["wall_s"] >= result["emulated_s"]
