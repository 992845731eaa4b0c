"""Combining parallelism: a planner for data, ZeRO, tensor and pipeline parallelism.

Data parallelism copies the model and all-reduces gradients once per optimizer
step; its traffic grows with the model, not with the batch. Tensor parallelism
(Megatron-LM, arXiv 1909.08053) splits each layer's matrices across ranks and
all-reduces *activations* inside every layer, forward and backward: heavy, so it
stays on the fast links inside a node. Pipeline parallelism cuts the model into
stages that pass activations point to point: little traffic, but idle "bubbles".
ZeRO partitions the model states of data parallelism. Rajbhandari's account
(REFERENCES.md, Lab 5) combines them ("3D"): TP inside the node, PP and ZeRO-DP
across nodes, each form used where its communication is cheapest.

The tensor-parallel MLP runs on real ranks (:mod:`labkit.tensor_parallel`). The
planner here is pure functions: for a model, a cluster shape and link speeds it
gives each layout's per-step traffic per device, the emulated time of that
traffic, and model-state memory per device.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence

from labkit.collectives import LINKS, Link, collective_time_s, ring_bytes_per_rank

try:
    from labkit.zero import model_state_bytes as _zero_model_state_bytes
except ImportError:  # pragma: no cover - labkit.zero is Lab 4's module
    _zero_model_state_bytes = None


def tp_all_reduces_per_layer(transformer: bool = True) -> int:
    """Activation all-reduces per layer per micro-batch, forward plus backward.

    A Megatron transformer layer has two TP blocks (attention and MLP), each one
    all-reduce forward and one backward: 4. The bare MLP above has one block: 2.
    """
    return 4 if transformer else 2


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs about the model: sizes and one micro-batch's activation shape."""

    num_params: int
    layers: int
    hidden: int
    seq_len: int = 2048
    micro_batch: int = 1
    bytes_per_value: int = 2

    def __post_init__(self) -> None:
        for name in ("num_params", "layers", "hidden", "seq_len", "micro_batch", "bytes_per_value"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def activation_bytes(self) -> int:
        """One micro-batch's activations at a layer boundary (what TP all-reduces and PP sends)."""
        return self.micro_batch * self.seq_len * self.hidden * self.bytes_per_value


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    intra_node: Link = LINKS["NVLink-class"]
    inter_node: Link = LINKS["100 Gbps"]

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {self.nodes}")
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")

    @property
    def devices(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Layout:
    """Degrees of each form; ranks are numbered TP-innermost, then DP, then PP (Megatron's order)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0
    accumulation: int = 1

    @property
    def name(self) -> str:
        parts = [f"DP{self.dp}" + (f"+ZeRO{self.zero_stage}" if self.zero_stage else "")]
        if self.tp > 1:
            parts.append(f"TP{self.tp}")
        if self.pp > 1:
            parts.append(f"PP{self.pp}")
        return " x ".join(parts)


def check_layout(layout: Layout, cluster: Cluster, model: ModelShape) -> None:
    """Raise ``ValueError`` naming the fix when ``layout`` cannot tile ``cluster`` or split ``model``."""
    for name in ("dp", "tp", "pp", "accumulation"):
        if getattr(layout, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(layout, name)}")
    if layout.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {layout.zero_stage}")
    used = layout.dp * layout.tp * layout.pp
    if used != cluster.devices:
        raise ValueError(
            f"dp x tp x pp must equal the cluster's {cluster.devices} devices "
            f"({cluster.nodes} nodes x {cluster.gpus_per_node}), got {layout.dp} x {layout.tp} x {layout.pp} = {used}"
        )
    if cluster.gpus_per_node % layout.tp:
        raise ValueError(
            f"tp must divide gpus_per_node={cluster.gpus_per_node} (tensor parallelism stays inside a node), got {layout.tp}"
        )
    if model.layers % layout.pp:
        raise ValueError(f"pp must divide the model's {model.layers} layers, got {layout.pp}")


def group_crosses_nodes(stride: int, size: int, gpus_per_node: int, devices: int) -> bool:
    """Whether any group of ``size`` ranks spaced ``stride`` apart spans more than one node."""
    block = stride * size
    for base in range(0, devices, block):
        for offset in range(stride):
            first, last = base + offset, base + offset + stride * (size - 1)
            if first // gpus_per_node != last // gpus_per_node:
                return True
    return False


def _state_bytes_fallback(num_params: int, stage: int, dp_degree: int) -> int:
    part = -(-num_params // dp_degree)
    return 2 * (part if stage >= 3 else num_params) + 2 * (part if stage >= 2 else num_params) + 12 * (
        part if stage >= 1 else num_params
    )


def model_state_bytes_per_device(num_params: int, stage: int, dp_degree: int) -> int:
    """Mixed-precision Adam's 16 bytes/param, partitioned by ZeRO (labkit.zero when present)."""
    if _zero_model_state_bytes is not None:
        return _zero_model_state_bytes(num_params, stage, dp_degree).total
    return _state_bytes_fallback(num_params, stage, dp_degree)


@dataclass(frozen=True)
class Plan:
    layout: Layout
    memory_bytes_per_device: int
    comm_bytes_per_device: dict[str, int] = field(default_factory=dict)
    comm_s: dict[str, float] = field(default_factory=dict)
    links: dict[str, str] = field(default_factory=dict)
    bubble_fraction: float = 0.0
    compute_s: float = 0.0
    samples_per_step: int = 0

    @property
    def step_s(self) -> float:
        """Compute stretched by the pipeline bubble, plus communication (no overlap: a pessimistic bound)."""
        return self.compute_s / (1 - self.bubble_fraction) + self.total_comm_s

    @property
    def samples_per_s(self) -> float:
        return self.samples_per_step / self.step_s if self.step_s > 0 else float("inf")

    @property
    def total_comm_bytes(self) -> int:
        return sum(self.comm_bytes_per_device.values())

    @property
    def total_comm_s(self) -> float:
        return sum(self.comm_s.values())


def plan(model: ModelShape, cluster: Cluster, layout: Layout, device_tflops: float = 100.0) -> Plan:
    """Per-device traffic and model-state memory of one optimizer step under ``layout``.

    Counted per device (ring bytes each rank sends), per optimizer step of
    ``accumulation`` micro-batches, with delayed gradient sync. ZeRO-1 sends what
    DP sends (reduce-scatter + all-gather = all-reduce); stage 2 reduce-scatters
    every micro-step and stage 3 also all-gathers parameters forward and backward
    every micro-step, as DeepSpeed does (PLATFORM-NOTES). Time is the alpha-beta
    model on the link each group crosses, without overlap; activations are not in
    the memory figure. Compute is 6 FLOPs per parameter per token at
    ``device_tflops`` sustained, split over the TP x PP devices of one replica.
    """
    if device_tflops <= 0:
        raise ValueError(f"device_tflops must be > 0, got {device_tflops}")
    check_layout(layout, cluster, model)
    dp, tp, pp, acc = layout.dp, layout.tp, layout.pp, layout.accumulation
    shard_params = -(-model.num_params // (tp * pp))
    grad_bytes = shard_params * model.bytes_per_value
    link_of = _group_links(cluster, layout)
    volume: dict[str, int] = {}
    seconds: dict[str, float] = {}

    def add(kind: str, op: str, message_bytes: int, world: int, times: int) -> None:
        volume[kind] = volume.get(kind, 0) + times * ring_bytes_per_rank(op, message_bytes, world)
        seconds[kind] = seconds.get(kind, 0.0) + times * collective_time_s(op, message_bytes, world, link_of[kind])

    if dp > 1:
        for op, times in _dp_collectives(layout.zero_stage, acc):
            add("dp", op, grad_bytes, dp, times)
    if tp > 1:
        per_layer = tp_all_reduces_per_layer(transformer=True)
        add("tp", "all_reduce", model.activation_bytes, tp, acc * per_layer * (model.layers // pp))
    if pp > 1:
        sends = 2 * acc
        volume["pp"] = sends * model.activation_bytes
        link = link_of["pp"]
        seconds["pp"] = sends * (link.latency_us * 1e-6 + model.activation_bytes / link.bytes_per_s)
    return Plan(
        layout=layout,
        memory_bytes_per_device=model_state_bytes_per_device(shard_params, layout.zero_stage, dp),
        comm_bytes_per_device=volume,
        comm_s=seconds,
        links={kind: link_of[kind].name for kind in volume},
        bubble_fraction=(pp - 1) / (acc + pp - 1),
        compute_s=6 * model.num_params * acc * model.micro_batch * model.seq_len / (tp * pp * device_tflops * 1e12),
        samples_per_step=dp * acc * model.micro_batch,
    )


def _group_links(cluster: Cluster, layout: Layout) -> dict[str, Link]:
    """The link each parallel group crosses: the slow inter-node one as soon as the group spans two nodes.

    TP ranks are adjacent, then DP, then PP (Megatron's order), so a group crosses
    nodes when its stride times its size leaves one node.
    """
    tp, dp, pp, gpn = layout.tp, layout.dp, layout.pp, cluster.gpus_per_node
    return {
        "tp": cluster.inter_node if tp > gpn else cluster.intra_node,
        "dp": cluster.inter_node if group_crosses_nodes(tp, dp, gpn, cluster.devices) else cluster.intra_node,
        "pp": cluster.inter_node if group_crosses_nodes(tp * dp, pp, gpn, cluster.devices) else cluster.intra_node,
    }


def _dp_collectives(zero_stage: int, accumulation: int) -> list[tuple[str, int]]:
    """(collective, times per optimizer step) a DP group issues at ``zero_stage``, as DeepSpeed does.

    Stages 0-1 sync once per window; stage 2 reduce-scatters every micro-step, and
    stage 3 also all-gathers the parameters for every forward and backward.
    """
    if zero_stage == 0:
        return [("all_reduce", 1)]
    if zero_stage == 1:
        return [("reduce_scatter", 1), ("all_gather", 1)]
    if zero_stage == 2:
        return [("reduce_scatter", accumulation), ("all_gather", 1)]
    return [("reduce_scatter", accumulation), ("all_gather", 2 * accumulation)]


def candidate_layouts(
    cluster: Cluster, model: ModelShape, zero_stages: Sequence[int] = (0, 1, 3), accumulation: int = 1
) -> list[Layout]:
    """Every layout that tiles the cluster: tp dividing the node, pp dividing the layers."""
    if accumulation < 1:
        raise ValueError(f"accumulation must be >= 1, got {accumulation}")
    layouts = []
    n = cluster.devices
    for tp, pp in itertools.product(range(1, cluster.gpus_per_node + 1), range(1, n + 1)):
        if cluster.gpus_per_node % tp or model.layers % pp or n % (tp * pp):
            continue
        dp = n // (tp * pp)
        stages = zero_stages if dp > 1 else (0,)
        layouts += [Layout(dp, tp, pp, stage, accumulation) for stage in stages]
    return layouts


def fits(plan_: Plan, device_memory_bytes: int) -> bool:
    return plan_.memory_bytes_per_device <= device_memory_bytes


def plan_rows(
    num_params: int,
    nodes: int,
    gpus_per_node: int,
    inter_node: str = "100 Gbps",
    intra_node: str = "NVLink-class",
    layers: int = 48,
    hidden: int = 4096,
    accumulation: int = 8,
    device_memory_gib: float = 80.0,
    zero_stages: Sequence[int] = (0, 1, 3),
    device_tflops: float = 100.0,
    seq_len: int = 2048,
    micro_batch: int = 1,
) -> list[dict[str, Any]]:
    """The widget's logic: every candidate layout as a row, fitting ones first, highest samples/s first."""
    for name, value in (("inter_node", inter_node), ("intra_node", intra_node)):
        if value not in LINKS:
            raise ValueError(f"{name} must be one of {sorted(LINKS)}, got {value!r}")
    if device_memory_gib <= 0:
        raise ValueError(f"device_memory_gib must be > 0, got {device_memory_gib}")
    model = ModelShape(num_params=num_params, layers=layers, hidden=hidden, seq_len=seq_len, micro_batch=micro_batch)
    cluster = Cluster(nodes, gpus_per_node, intra_node=LINKS[intra_node], inter_node=LINKS[inter_node])
    rows = []
    for layout in candidate_layouts(cluster, model, zero_stages, accumulation):
        p = plan(model, cluster, layout, device_tflops)
        rows.append({
            "layout": layout.name,
            "memory_gib": p.memory_bytes_per_device / 2**30,
            "fits": fits(p, int(device_memory_gib * 2**30)),
            "comm_gib_per_step": p.total_comm_bytes / 2**30,
            "comm_s_per_step": p.total_comm_s,
            "bubble_fraction": p.bubble_fraction,
            "compute_s_per_step": p.compute_s,
            "step_s": p.step_s,
            "samples_per_s": p.samples_per_s,
            "samples_per_step": p.samples_per_step,
            "links": ", ".join(f"{k}: {v}" for k, v in p.links.items()),
        })
    rows.sort(key=lambda r: (not r["fits"], -r["samples_per_s"]))
    return rows


def plot_plans(rows: Sequence[dict[str, Any]], top: int = 10, device_memory_gib: float | None = None):
    """Two panels: model-state memory per device; time per sample split into compute, bubble and communication."""
    from labkit.plots import BASELINE, FIX, WARN, figure

    rows = list(rows)[:top]
    fig, (mem_ax, time_ax) = figure(2, width=11, height=4.2)
    labels = [r["layout"] for r in rows]
    mem_ax.barh(labels, [r["memory_gib"] for r in rows], color=[FIX if r["fits"] else BASELINE for r in rows])
    if device_memory_gib:
        mem_ax.axvline(device_memory_gib, color=WARN, linestyle="--", label="device memory")
        mem_ax.legend()
    mem_ax.set_xlabel("model states per device (GiB)")
    mem_ax.invert_yaxis()
    per_sample_ms = [1e3 / r["samples_per_step"] for r in rows]
    compute = [r["compute_s_per_step"] * k for r, k in zip(rows, per_sample_ms)]
    bubble = [(r["step_s"] - r["compute_s_per_step"] - r["comm_s_per_step"]) * k for r, k in zip(rows, per_sample_ms)]
    comm = [r["comm_s_per_step"] * k for r, k in zip(rows, per_sample_ms)]
    time_ax.barh(labels, compute, color=FIX, label="compute")
    time_ax.barh(labels, bubble, left=compute, color=BASELINE, label="pipeline bubble")
    time_ax.barh(labels, comm, left=[c + b for c, b in zip(compute, bubble)], color=WARN, label="communication")
    time_ax.set_xlabel("cluster ms per sample (model; lower is better)")
    time_ax.invert_yaxis()
    time_ax.set_yticklabels([])
    time_ax.legend(fontsize=8)
    fig.suptitle("Planner (a model, not a measurement): fitting layouts in blue, best samples/s first")
    fig.tight_layout()
    return fig


def planner_widget():
    """Sliders for model size, cluster shape and inter-node link; redraws from :func:`plan_rows`."""
    import ipywidgets as widgets

    from labkit.widgets import live

    controls = {
        "params_billion": widgets.FloatLogSlider(value=7, base=10, min=-1, max=3, description="params (B)"),
        "nodes": widgets.IntSlider(value=4, min=1, max=64, description="nodes"),
        "gpus_per_node": widgets.Dropdown(options=[1, 2, 4, 8], value=8, description="GPUs/node"),
        "inter_node": widgets.Dropdown(options=list(LINKS), value="100 Gbps", description="inter-node"),
        "accumulation": widgets.IntSlider(value=8, min=1, max=64, description="accumulation"),
    }

    def render(params_billion: float, nodes: int, gpus_per_node: int, inter_node: str, accumulation: int):
        rows = plan_rows(int(params_billion * 1e9), nodes, gpus_per_node,
                         inter_node=inter_node, accumulation=accumulation)
        return plot_plans(rows, device_memory_gib=80.0)

    return live(render, controls, rows=[["params_billion", "nodes", "gpus_per_node"],
                                        ["inter_node", "accumulation"]])
