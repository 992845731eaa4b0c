"""A tensor-parallel layer on real ranks, and the planner's cost model."""

import pytest

from labkit import parallelism as p
from labkit import tensor_parallel
from labkit.collectives import LINKS, ring_bytes_per_rank

MODEL = p.ModelShape(num_params=1_000_000_000, layers=24, hidden=2048, seq_len=1024, micro_batch=2)
CLUSTER = p.Cluster(nodes=4, gpus_per_node=8)


@pytest.mark.slow
def test_tensor_parallel_mlp_matches_the_full_layer_with_one_all_reduce_each_way():
    result = tensor_parallel.run_tensor_parallel(2, sizes=tensor_parallel.TensorParallelSizes(
        hidden=64, ffn=256, tokens=16, layers=2))
    layers, n = result.layers, result.world_size
    assert result.max_output_error < 1e-4
    assert result.max_input_grad_error < 1e-4
    assert result.forward_all_reduce_calls == layers
    assert result.counts["all_reduce"].calls == p.tp_all_reduces_per_layer(transformer=False) * layers
    expected = 2 * layers * ring_bytes_per_rank("all_reduce", result.activation_bytes, n)
    assert result.counts["all_reduce"].ring_bytes == expected
    assert result.shard_params < result.full_params


@pytest.mark.parametrize(
    "layout, message",
    [
        (p.Layout(dp=3, tp=8, pp=1), "dp x tp x pp must equal the cluster's 32 devices"),
        (p.Layout(dp=4, tp=16, pp=1), "dp x tp x pp must equal|tp must divide"),
        (p.Layout(dp=8, tp=2, pp=2, zero_stage=4), "zero_stage must be"),
        (p.Layout(dp=0, tp=8, pp=4), "dp must be >= 1"),
        (p.Layout(dp=2, tp=1, pp=16), "pp must divide the model's 24 layers"),
        (p.Layout(dp=32, accumulation=0), "accumulation must be >= 1"),
    ],
)
def test_layouts_that_cannot_tile_the_cluster_are_refused(layout, message):
    with pytest.raises(ValueError, match=message):
        p.plan(MODEL, CLUSTER, layout)


def test_tensor_parallelism_must_stay_inside_a_node():
    with pytest.raises(ValueError, match="tp must divide gpus_per_node=8"):
        p.plan(MODEL, p.Cluster(nodes=6, gpus_per_node=8), p.Layout(dp=4, tp=12, pp=1))


def test_bad_cluster_and_link_inputs_are_refused():
    with pytest.raises(ValueError, match="nodes must be >= 1"):
        p.Cluster(nodes=0, gpus_per_node=8)
    with pytest.raises(ValueError, match="inter_node must be one of"):
        p.plan_rows(10**9, 2, 8, inter_node="10 Gbps")
    with pytest.raises(ValueError, match="num_params must be >= 1"):
        p.ModelShape(num_params=0, layers=1, hidden=1)


def test_zero3_model_states_per_device_are_one_over_n_of_data_parallel():
    dp = p.plan(MODEL, CLUSTER, p.Layout(dp=32))
    zero3 = p.plan(MODEL, CLUSTER, p.Layout(dp=32, zero_stage=3))
    assert dp.memory_bytes_per_device == 16 * MODEL.num_params
    assert zero3.memory_bytes_per_device == 16 * -(-MODEL.num_params // 32)


def test_data_parallel_sends_one_ring_all_reduce_of_the_gradients_per_step():
    plan = p.plan(MODEL, CLUSTER, p.Layout(dp=32, accumulation=8))
    assert plan.comm_bytes_per_device == {"dp": ring_bytes_per_rank("all_reduce", 2 * MODEL.num_params, 32)}
    assert plan.links == {"dp": "100 Gbps"}


def test_zero1_moves_what_dp_moves_and_zero3_half_as_much_again():
    dp, z1, z3 = (p.plan(MODEL, CLUSTER, p.Layout(dp=32, zero_stage=s)) for s in (0, 1, 3))
    assert z1.total_comm_bytes == dp.total_comm_bytes
    assert z3.total_comm_bytes == pytest.approx(1.5 * dp.total_comm_bytes, rel=1e-6)


def test_accumulation_amortises_data_parallel_traffic_per_sample():
    slow = p.Cluster(nodes=4, gpus_per_node=8, inter_node=LINKS["4 Gbps Ethernet"])
    one, sixteen = (p.plan(MODEL, slow, p.Layout(dp=32, accumulation=a)) for a in (1, 16))
    assert one.total_comm_bytes == sixteen.total_comm_bytes
    assert sixteen.samples_per_s > 4 * one.samples_per_s


def test_tensor_parallel_traffic_stays_on_the_fast_intra_node_link():
    plan = p.plan(MODEL, CLUSTER, p.Layout(dp=4, tp=8, pp=1))
    assert plan.links["tp"] == "NVLink-class"
    assert plan.links["dp"] == "100 Gbps"
    assert plan.comm_bytes_per_device["tp"] == 4 * MODEL.layers * ring_bytes_per_rank(
        "all_reduce", MODEL.activation_bytes, 8
    )


def test_pipeline_bubble_shrinks_with_more_micro_batches():
    few, many = (p.plan(MODEL, CLUSTER, p.Layout(dp=8, pp=4, accumulation=a)) for a in (1, 32))
    assert few.bubble_fraction == pytest.approx(0.75)
    assert many.bubble_fraction < 0.1


def test_every_candidate_layout_tiles_the_cluster_and_widget_rows_put_fitting_layouts_first():
    layouts = p.candidate_layouts(CLUSTER, MODEL)
    assert layouts and all(l.dp * l.tp * l.pp == CLUSTER.devices for l in layouts)
    rows = p.plan_rows(7 * 10**9, 4, 8, device_memory_gib=40)
    fits = [r["fits"] for r in rows]
    assert fits == sorted(fits, reverse=True) and any(fits) and not all(fits)


def test_group_crosses_nodes_only_when_it_spans_two():
    assert not p.group_crosses_nodes(1, 8, 8, 32)
    assert p.group_crosses_nodes(8, 4, 8, 32)
    assert p.group_crosses_nodes(2, 8, 8, 32)


def test_a_tensor_parallel_size_table_without_layers_fails_when_built():
    with pytest.raises(ValueError, match=r"TensorParallelSizes.layers must be >= 1, got 0"):
        tensor_parallel.TensorParallelSizes(hidden=256, ffn=1024, tokens=64, layers=0)


def _bert_on_64_nodes_over_4_gbps(accumulation: int) -> dict:
    rows = p.plan_rows(340_000_000, 64, 1, inter_node="4 Gbps Ethernet", layers=24, hidden=1024, seq_len=128,
                       micro_batch=4, accumulation=accumulation, device_memory_gib=32, zero_stages=(0,),
                       device_tflops=30)
    return next(r for r in rows if r["layout"] == "DP64")


def test_bert_on_64_nodes_over_4_gbps_gains_over_5x_samples_per_s_by_accumulating_16_micro_batches():
    """Lab 5's planner cell: the 2019 story, where the link, not the compute, set the pace."""
    assert _bert_on_64_nodes_over_4_gbps(16)["samples_per_s"] > 5 * _bert_on_64_nodes_over_4_gbps(1)["samples_per_s"]


def test_a_530b_model_on_2240_devices_is_best_served_by_tp_and_pp_with_data_parallelism():
    """Lab 5's 3D cell: TP inside nodes and PP across them beat ZeRO-3 alone by over 2x; pure DP does not fit."""
    big = p.plan_rows(530 * 10**9, 280, 8, inter_node="100 Gbps", layers=105, hidden=20480, accumulation=64,
                      device_memory_gib=80, device_tflops=120)
    best = big[0]
    assert best["fits"] and "TP" in best["layout"] and "PP" in best["layout"]
    zero3_alone = next(r for r in big if r["layout"] == "DP2240+ZeRO3")
    assert zero3_alone["fits"] and zero3_alone["samples_per_s"] < best["samples_per_s"] / 2
    assert not next(r for r in big if r["layout"] == "DP2240")["fits"]
