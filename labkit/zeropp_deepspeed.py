"""DeepSpeed's own ZeRO-3 engine and its ZeRO++ flags, on the same 2 x 2 nodes as labkit's.

The flags are ZeRO-3 settings: ``zero_quantized_weights`` (qwZ),
``zero_hpz_partition_size`` (hpZ) and ``zero_quantized_gradients`` (qgZ). The two
quantized ones call DeepSpeed's CUDA-only quantizer kernels (on CPU ranks they
raise "not implemented on CPU backend"), so CPU ranks run ZeRO-3 and hpZ only;
GPU ranks run all three. On CPU ranks the engine runs on a
:class:`labkit.fabric.Fabric` where one can be built, and the cross-node bytes
are the links' kernel counters; labkit's counter adds which collectives went
where (and stands in for the bytes where the links are emulated). The ranks send
back plain dictionaries; :func:`run` makes each config's a :class:`DeepSpeedRun`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit.fabric import LinkBytes
from labkit.launcher import rank_device, rank_info
from labkit.profiles import require_at_least
from labkit.quantcomm import NodeLayout
from labkit.zeropp import NodeAwareCounter, _mean_over_ranks, batch, flat_numel, init_flat
from labkit.zeropp_fabric import FabricLinks, return_freed_memory_to_the_os
from labkit.zeropp_model import busiest


@dataclass(frozen=True)
class DeepSpeedSizes:
    """An MLP of layer widths ``dims`` trained ``steps`` measured steps per DeepSpeed config."""

    dims: tuple[int, ...]
    steps: int

    def __post_init__(self) -> None:
        if len(self.dims) < 2 or min(self.dims) < 1:
            raise ValueError(f"DeepSpeedSizes.dims must be two or more widths >= 1, got {self.dims}")
        require_at_least(self, 1, "steps")


SIZES = {
    "ci": DeepSpeedSizes(dims=(256, 512, 512, 256), steps=2),
    "gpu": DeepSpeedSizes(dims=(256, 512, 512, 256), steps=3),
    "multi-gpu": DeepSpeedSizes(dims=(1024, 2048, 2048, 1024), steps=10),
}


@dataclass(frozen=True)
class DeepSpeedRun:
    """One DeepSpeed config's measured steps: cross-node bytes per step, and which collectives went where.

    ``cross_node_bytes_per_step`` is the busiest link's payload where the links
    are real (``link_bytes`` holds every link's counters), else labkit's counter;
    ``counted_cross_node_bytes_per_step`` is always the counter's, to set beside
    it. The ``*_ops`` count calls by collective: hpZ shows as all-gathers that
    move from the cross-node side to the intra-node one.
    """

    config: str
    links: str
    link_bytes: dict[str, LinkBytes]
    cross_node_bytes_per_step: float
    counted_cross_node_bytes_per_step: float
    intra_node_bytes_per_step: float
    cross_node_ops: dict[str, int]
    intra_node_ops: dict[str, int]
    loss: list[float]
    num_params: int

    def describe(self) -> str:
        """Cross-node bytes in M of fp32 weights (the engine trains in fp32 on CPU ranks), intra-node in MB."""
        m_bytes = 4 * self.num_params
        return (f"{self.config:7s} links: {self.links}; cross-node {self.cross_node_bytes_per_step / m_bytes:.3f}M (fp32)/step "
                f"{self.cross_node_ops}; intra-node {self.intra_node_bytes_per_step / 1e6:5.2f} MB/step "
                f"{self.intra_node_ops}")


def configs(on_gpus: bool, ranks_per_node: int) -> dict[str, dict[str, Any]]:
    """ZeRO-3 beside DeepSpeed's ZeRO++ flags; the quantized ones need CUDA kernels (PLATFORM-NOTES)."""
    out: dict[str, dict[str, Any]] = {"ZeRO-3": {}, "hpZ": {"zero_hpz_partition_size": ranks_per_node}}
    if on_gpus:
        out["qwZ"] = {"zero_quantized_weights": True}
        out["qgZ"] = {"zero_quantized_gradients": True}
        out["ZeRO++"] = {"zero_quantized_weights": True, "zero_hpz_partition_size": ranks_per_node,
                         "zero_quantized_gradients": True}
    return out


def _engine(dims: tuple[int, ...], extra: dict[str, Any], batch_size: int, seed: int) -> Any:
    import deepspeed

    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(zip(dims[:-1], dims[1:])):
        layers += [torch.nn.Linear(fan_in, fan_out)] + ([torch.nn.ReLU()] if i < len(dims) - 2 else [])
    config = {
        "train_micro_batch_size_per_gpu": batch_size,
        # bf16 on GPUs; on CPU ranks DeepSpeed's hpZ moved nothing into the node in bf16 (measured), so fp32.
        "bf16": {"enabled": rank_device().type == "cuda"},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 2**20, "stage3_prefetch_bucket_size": 2**20,
                              "stage3_param_persistence_threshold": 0,
                              # free gathered weights after use, so the backward pass gathers again (as ZeRO-3 does)
                              "stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 0, **extra},
    }
    engine, *_ = deepspeed.initialize(model=torch.nn.Sequential(*layers), config=config)
    return engine


def deepspeed_rank(
    dims: tuple[int, ...],
    steps: int,
    configs: dict[str, dict[str, Any]],
    fab: Any = None,
    ranks_per_node: int = 2,
    batch_size: int = 4,
    seed: int = 0,
) -> dict[str, Any]:
    """Rank function: each config's training steps, cross-node bytes per step from the links (or the counter).

    DeepSpeed binds torch's collectives when it initialises, so the counter is
    entered before ``init_distributed``. One warm-up step per engine stays outside
    the measured window (its first gathers set up the parameter cache).
    """
    import deepspeed

    return_freed_memory_to_the_os()
    layout = NodeLayout.for_world(dist.get_world_size(), ranks_per_node)
    links = FabricLinks(fab) if fab is not None else None
    out: dict[str, Any] = {}
    with NodeAwareCounter(layout) as counter:
        deepspeed.init_distributed(dist_backend=rank_info().backend)
        teacher = init_flat(dims, flat_numel(dims), seed + 1000).to(rank_device())
        for label, extra in configs.items():
            engine = _engine(dims, extra, batch_size, seed)
            losses: list[float] = []

            def train(n: int) -> None:
                for _ in range(n):
                    x, y = batch(dims, teacher, batch_size, seed=len(losses) * 1000 + dist.get_rank())
                    # DeepSpeed does not cast inputs to the engine's bf16 weights.
                    x = x.to(torch.bfloat16) if rank_device().type == "cuda" else x
                    loss = F.mse_loss(engine(x).float(), y)
                    engine.backward(loss)
                    engine.step()
                    losses.append(_mean_over_ranks(loss.item()))

            train(1)
            counter.reset()
            counter.intra.reset()
            traffic = links.measure(lambda: train(steps)) if links else {}
            if not links:
                train(steps)
            out[label] = {
                "config": label,
                "links": links.name if links else "emulated",
                "link_bytes": traffic,
                "cross_node_bytes_per_step": (busiest(traffic, wire=False) if links else counter.cross_node_bytes()) / steps,
                "counted_cross_node_bytes_per_step": counter.cross_node_bytes() / steps,
                "intra_node_bytes_per_step": counter.intra_node_bytes() / steps,
                "cross_node_ops": {op: c.calls for op, c in counter.counts.items() if c.calls},
                "intra_node_ops": {op: c.calls for op, c in counter.intra.counts.items() if c.calls},
                "loss": losses,
                "num_params": sum(p.ds_numel for p in engine.module.parameters()),
            }
            engine.destroy()
    return out


def run(world_size: int = 4, ranks_per_node: int = 2, *, links: str | None = None,
        timeout_s: float = 600.0) -> dict[str, DeepSpeedRun]:
    """DeepSpeed's ZeRO-3 engine with its ZeRO++ flags on real ranks; on CPU ranks, hpZ only, on a fabric if possible.

    Keyed by config label (``"ZeRO-3"``, ``"hpZ"``, and on GPUs ``"qwZ"``, ``"qgZ"``, ``"ZeRO++"``).
    """
    from labkit import dsops, fabric
    from labkit.launcher import launch
    from labkit.profiles import profile
    from labkit.topology import GBIT, Topology

    layout = NodeLayout.for_world(world_size, ranks_per_node)
    if layout.nodes < 2:
        raise ValueError(f"need at least 2 nodes, got world_size={world_size}, ranks_per_node={ranks_per_node}")
    prof = profile()
    backend = prof.backend_for(world_size)
    on_gpus = backend == "nccl"
    # Built here, once, not by every rank inside the launch timeout.
    dsops.ensure_built((dsops.COMM_OP, dsops.QUANTIZER_OP) if on_gpus else (dsops.COMM_OP,),
                       accelerator=dsops.accelerator_for(backend))
    sizes = prof.pick(SIZES)
    kwargs = dict(dims=sizes.dims, steps=sizes.steps, ranks_per_node=ranks_per_node,
                  configs=configs(on_gpus, ranks_per_node))
    mode = links or ("emulated" if on_gpus else fabric.probe().mode)
    if mode != "namespaces":
        out = launch(deepspeed_rank, world_size, backend=backend, timeout_s=timeout_s, **kwargs)[0]
    else:
        topology = Topology(nodes=layout.nodes, ranks_per_node=ranks_per_node, inter_node_bytes_per_s=10 * GBIT)
        with fabric.Fabric(topology) as fab:
            out = launch(deepspeed_rank, world_size, backend=backend, timeout_s=timeout_s, fabric=fab, fab=fab,
                         **kwargs)[0]
    return {label: DeepSpeedRun(**fields) for label, fields in out.items()}
