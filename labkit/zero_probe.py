"""Measure what real DeepSpeed ZeRO engines hold per rank, and what each stage costs in time.

:mod:`labkit.zero` predicts per-rank bytes; this module checks the prediction on
real engines running on real ranks. One launch builds an engine per
configuration (stages 0-3, then CPU offload, then NVMe offload where
:mod:`labkit.nvme_offload` says it can run) and weighs every tensor it holds,
sorted into parameters, gradients, optimizer state and buffers
(:mod:`labkit.zero_accounting`).

Two moments are sampled per configuration: the end of the backward pass, before
DeepSpeed's final gradient reduction (the peak of gradient memory: at stages 0-1
every gradient is alive there) and after the optimizer step (Adam's moments
exist only from the first step on). Each state's bytes are the larger of the two.
Then the engines take turns timing steps (forward, backward and optimizer step
apart, with the collectives of each counted), on a fabric count their bytes on
the links (:mod:`labkit.zero_traffic`), and last each measures what one more step
adds at its peak.
"""

from __future__ import annotations

import contextlib
import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from labkit import dsops, nvme_offload, zero, zero_accounting, zero_traffic
from labkit.processes import temporary_folder

BUCKET_ELEMS = 2**16


@dataclass(frozen=True)
class ProbeConfig:
    """One engine to build: a ZeRO stage and where (if anywhere) state is offloaded."""

    name: str
    stage: int
    offload_optimizer: str = "none"
    offload_param: str = "none"

    @property
    def offloaded(self) -> bool:
        return self.offload_optimizer != "none" or self.offload_param != "none"


BASE_CONFIGS = tuple(ProbeConfig(f"stage {s}", s) for s in zero.STAGES)
CPU_OFFLOAD_CONFIGS = (
    ProbeConfig("stage 2 + optimizer->CPU", 2, offload_optimizer="cpu"),
    ProbeConfig("stage 3 + optimizer,params->CPU", 3, offload_optimizer="cpu", offload_param="cpu"),
)
NVME_CONFIG = ProbeConfig("stage 3 + optimizer,params->NVMe", 3, offload_optimizer="nvme",
                          offload_param="nvme")


@dataclass(frozen=True)
class ProbeSize:
    """A stack of ``layers`` square Linear layers: many small tensors, so ZeRO's
    partition boundaries fall near tensor boundaries, as in a real transformer."""

    layers: int
    width: int
    batch: int
    steps: int

    @property
    def num_params(self) -> int:
        return self.layers * (self.width * self.width + self.width)

    @property
    def largest_layer_params(self) -> int:
        return self.width * self.width + self.width

    def activation_bytes(self, bytes_per_element: int = 2) -> int:
        """What the forward pass saves for the backward: each Linear's input, on every rank whatever the stage."""
        return self.layers * self.batch * self.width * bytes_per_element


SIZES = {
    "ci": ProbeSize(layers=24, width=192, batch=1024, steps=3),
    "gpu": ProbeSize(layers=64, width=256, batch=1024, steps=6),
    "multi-gpu": ProbeSize(layers=96, width=1024, batch=1024, steps=6),
}
"""A batch whose activations are of the order of a stage-0 rank's model states
(about 0.66x at ci), as in real training: ZeRO partitions the states and not the
activations, which is why a step's peak shrinks less than the state between steps.
At batch 16 the activations were 1% of the states and that comparison rested on
what gloo allocated, a 1-2 MB spread between ranks (stage 3's peak over its state
1.14-1.42x stage 0's); at 1024, 1.47-1.90x in ten runs of Lab 4."""


@dataclass(frozen=True)
class RankMeasurement:
    """What one rank held under one configuration, and how long its steps took."""

    config: ProbeConfig
    rank: int
    dp_degree: int
    num_params: int
    dtype: str
    accelerator: dict[str, int]
    host: dict[str, int]
    optimizer_class: str
    step_ms: list[float] = field(default_factory=list)
    update_ms: list[float] = field(default_factory=list)
    init_ms: float = 0.0
    traffic: zero_traffic.StageTraffic | None = None
    """What this rank's node link carried per step (stages 0-3 on a fabric only)."""
    step_peak_added_bytes: int | None = None
    forward_ms: list[float] = field(default_factory=list)
    collective_calls: dict[str, dict[str, int]] = field(default_factory=dict)
    """Calls of each collective in one step, by phase (forward, backward, step)."""
    """Memory one step added above what the rank held between steps, at its peak (stages 0-3)."""

    @property
    def model_states(self) -> zero.ModelStateBytes:
        """Accelerator plus host bytes of params, grads and optimizer (buffers excluded)."""
        return zero.ModelStateBytes(*(self.accelerator[r] + self.host[r] for r in zero.STATE_KEYS[:3]))

    @property
    def on_accelerator(self) -> zero.ModelStateBytes:
        return zero.ModelStateBytes(*(self.accelerator[r] for r in zero.STATE_KEYS[:3]))

    @property
    def offloaded(self) -> zero.ModelStateBytes:
        return zero.ModelStateBytes(*(self.host[r] for r in zero.STATE_KEYS[:3]))

    @property
    def held(self) -> dict[str, int]:
        """Every class of bytes the rank held between steps, accelerator plus host, buffers included."""
        return {role: self.accelerator[role] + self.host[role] for role in zero_accounting.ROLES}

    @property
    def peak_during_step_bytes(self) -> int | None:
        """What the rank held between steps plus what one step added at its peak."""
        if self.step_peak_added_bytes is None:
            return None
        return sum(self.held.values()) + self.step_peak_added_bytes

    def best_phase_ms(self) -> dict[str, float]:
        """Fastest forward, backward (with what it communicates) and optimizer step over the timed steps."""
        backward = [w - f - u for w, f, u in zip(self.step_ms, self.forward_ms, self.update_ms)]
        return {"forward": min(self.forward_ms), "backward": min(backward), "step": min(self.update_ms)}

    @property
    def median_step_ms(self) -> float:
        return statistics.median(self.step_ms)

    @property
    def best_step_ms(self) -> float:
        """The fastest step: on a shared machine the least disturbed by other work."""
        return min(self.step_ms)


def default_dtype(backend: str | None = None) -> str:
    """bf16 where the ranks' accelerator supports it (every CPU DeepSpeed runs on), else fp16.

    A gloo rank gets bf16 even when this machine's GPU is a V100 or T4 (no bf16, so
    the parent's own choice would be fp16, which DeepSpeed refuses on the CPU).
    """
    return "bf16" if dsops.ranks_accelerator(backend).is_bf16_supported() else "fp16"


def check_dtype_supported(dtype: str, backend: str | None = None) -> None:
    """Refuse, before any rank starts, a precision DeepSpeed would refuse inside every rank."""
    if dtype not in ("bf16", "fp16"):
        raise ValueError(f"dtype must be 'bf16' or 'fp16', got {dtype!r}")
    accelerator = dsops.ranks_accelerator(backend)
    supported = accelerator.is_bf16_supported() if dtype == "bf16" else accelerator.is_fp16_supported()
    if not supported:
        other = "fp16" if dtype == "bf16" else "bf16"
        raise ValueError(
            f"dtype={dtype!r} is not supported by DeepSpeed's {accelerator.device_name()} accelerator, "
            f"where the {backend or 'profile'} ranks run (it refuses fp16 on the CPU); use dtype={other!r}"
        )


def deepspeed_config(config: ProbeConfig, *, dtype: str, batch: int, nvme_dir: str | None = None) -> dict:
    """The DeepSpeed config for one probe: small buckets, nothing kept resident at stage 3."""
    zero_cfg: dict[str, Any] = {
        "stage": config.stage,
        "reduce_bucket_size": BUCKET_ELEMS,
        "allgather_bucket_size": BUCKET_ELEMS,
        "overlap_comm": False,
        "stage3_param_persistence_threshold": 0,
        "stage3_prefetch_bucket_size": BUCKET_ELEMS,
        "stage3_max_live_parameters": BUCKET_ELEMS,
        "stage3_max_reuse_distance": 0,
    }
    for key, target in (("offload_optimizer", config.offload_optimizer),
                        ("offload_param", config.offload_param)):
        if target == "cpu":
            zero_cfg[key] = {"device": "cpu", "pin_memory": True}
        elif target == "nvme":
            zero_cfg[key] = {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        dtype: {"enabled": True},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": not config.offloaded}},
        "zero_optimization": zero_cfg,
        "steps_per_print": 10**9,
    }


def _build_model(size: ProbeSize):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(size.width, size.width) for _ in range(size.layers)])


def _build_engine(config: ProbeConfig, size: ProbeSize, dtype: str, device: str,
                  nvme_dir: str | None):
    """A fresh model and engine; on CPU ranks (and for offload) Adam is DeepSpeed's CPU Adam,
    so with and without offload every rank runs the same Adam kernel."""
    import deepspeed

    model = _build_model(size)
    ds_config = deepspeed_config(config, dtype=dtype, batch=size.batch, nvme_dir=nvme_dir)
    optimizer = None
    if device == "cpu" or config.offloaded:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        ds_config.pop("optimizer")
        optimizer = DeepSpeedCPUAdam(model.parameters(), lr=1e-3, adamw_mode=False)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config, optimizer=optimizer,
                                      model_parameters=model.parameters())
    return engine


def _train_step(engine, batch) -> None:
    loss = engine(batch).float().pow(2).mean()
    engine.backward(loss)
    engine.step()


def _timed_step(engine, batch) -> float:
    from labkit.devices import Stopwatch

    with Stopwatch(engine.device) as whole:
        _train_step(engine, batch)
    return whole.ms


def probe_rank(configs: list[ProbeConfig], size: ProbeSize, dtype: str, nvme_dir: str | None = None,
               fab: Any = None, traffic: zero_traffic.TrafficSize | None = None) -> list[RankMeasurement]:
    """Rank function: build every config's engine, weigh it, then time their steps in turn.

    On a fabric (``fab``), the engines without offload then count their bytes on
    the links and time their steps on a slow link (:mod:`labkit.zero_traffic`).

    DeepSpeed allows several engines in one process after one ``init_distributed``;
    each engine gets a fresh model, so no ZeRO-3 hooks carry over. Steps are timed
    round-robin (one step of each engine, then again), so a burst of load from
    elsewhere on the machine slows every configuration alike instead of one.
    """
    import deepspeed
    import torch

    from labkit.devices import Stopwatch
    from labkit.launcher import rank_info

    info = rank_info()
    deepspeed.init_distributed(dist_backend=info.backend)
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float16
    engines, batches, weighed, init_ms = [], [], [], []
    for config in configs:
        with Stopwatch("cpu") as init:
            engine = _build_engine(config, size, dtype, info.device, nvme_dir)
        generator = torch.Generator().manual_seed(info.rank)
        batch = torch.randn(size.batch, size.width, generator=generator).to(engine.device, torch_dtype)
        weighed.append(zero_accounting.weigh_one_step(engine, lambda: _train_step(engine, batch)))
        engines.append(engine)
        batches.append(batch)
        init_ms.append(init.ms)
    step_ms, forward_ms, update_ms = ([[] for _ in configs] for _ in range(3))
    calls = [{} for _ in configs]
    for round_ in range(size.steps):
        for i, (engine, batch) in enumerate(zip(engines, batches)):
            with zero_traffic.counted_collectives() as counted, Stopwatch(engine.device) as whole:
                with Stopwatch(engine.device) as forward:
                    loss = engine(batch).float().pow(2).mean()
                counted.phase = "backward"
                engine.backward(loss)
                counted.phase = "step"
                with Stopwatch(engine.device) as update:
                    engine.step()
            step_ms[i].append(whole.ms)
            forward_ms[i].append(forward.ms)
            update_ms[i].append(update.ms)
            calls[i] = calls[i] or counted.calls
    plain = [i for i, config in enumerate(configs) if not config.offloaded]
    on_links = {} if fab is None else dict(zip(plain, zero_traffic.measure_on_links(
        fab, [configs[i].stage for i in plain], [engines[i] for i in plain], [batches[i] for i in plain],
        _timed_step, traffic)))
    if info.device == "cpu":
        from labkit.zeropp_fabric import return_freed_memory_to_the_os

        return_freed_memory_to_the_os(zero_accounting.OWN_MAPPING_BYTES)  # last: it slows every step after it
    peaks = {i: zero_accounting.step_peak_added_bytes(lambda i=i: _train_step(engines[i], batches[i]), info.device)
             for i in plain}
    results = []
    for i, (config, engine) in enumerate(zip(configs, engines)):
        accelerator, host = weighed[i]
        results.append(RankMeasurement(
            config=config, rank=info.rank, dp_degree=info.world_size,
            num_params=sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                           for p in engine.module.parameters()),
            dtype=dtype, accelerator=accelerator, host=host,
            optimizer_class=type(engine.basic_optimizer).__name__, step_ms=step_ms[i],
            update_ms=update_ms[i], init_ms=init_ms[i], traffic=on_links.get(i), forward_ms=forward_ms[i],
            collective_calls=calls[i],
            step_peak_added_bytes=peaks.get(i),
        ))
    for engine in engines:
        engine.destroy()
    return results


def measure(
    configs: Iterable[ProbeConfig] | None = None,
    *,
    size: ProbeSize | None = None,
    dtype: str | None = None,
    ranks: int | None = None,
    backend: str | None = None,
    timeout_s: float = 600.0,
    on_links: bool = False,
) -> list[RankMeasurement]:
    """Run every config on real ranks in ONE launch; measurements of every rank, config-major.

    Defaults come from the active profile. ``backend="nccl"`` puts the ranks on GPUs
    (one per rank): with one GPU, ``ranks=1`` is how offload gets timed across a real
    PCIe bus. ``on_links=True`` puts each gloo rank on its own node of a fabric and
    counts what the engines send (:mod:`labkit.zero_traffic`; needs
    ``labkit.fabric.probe()`` to say ``"namespaces"``). Bad input is refused here,
    before any rank starts; the DeepSpeed ops are built (once per environment) in this process.
    """
    from labkit import dsops, fabric, profile
    from labkit.launcher import check_backend, launch

    prof = profile()
    configs = list(configs if configs is not None else BASE_CONFIGS + CPU_OFFLOAD_CONFIGS)
    size = size or prof.pick(SIZES)
    ranks = prof.ranks if ranks is None else ranks
    backend = backend or prof.backend
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    check_backend(backend)
    if on_links and (backend != "gloo" or ranks < 2):
        raise ValueError(f"on_links needs gloo ranks on 2 or more nodes, got backend={backend!r}, ranks={ranks}")
    if not configs:
        raise ValueError("configs must name at least one ProbeConfig")
    for config in configs:
        zero.offload_placement(size.num_params, config.stage, ranks,
                               optimizer_target=config.offload_optimizer,
                               param_target=config.offload_param)
    for name, value in (("layers", size.layers), ("width", size.width), ("batch", size.batch),
                        ("steps", size.steps)):
        if value < 1:
            raise ValueError(f"size.{name} must be >= 1, got {value}")
    dtype = dtype or default_dtype(backend)
    check_dtype_supported(dtype, backend)
    ops = [dsops.COMM_OP]
    if any(c.offloaded for c in configs):
        ops.append(dsops.CPU_ADAM_OP)
    nvme_dir = None
    if any("nvme" in (c.offload_optimizer, c.offload_param) for c in configs):
        parent = nvme_offload.nvme_parent_dir()
        available, reason = nvme_offload.nvme_available(prof.name, backend=backend, nvme_dir=parent)
        if not available:
            raise ValueError(f"NVMe offload requested but unavailable: {reason}")
        ops.append(dsops.ASYNC_IO_OP)
    dsops.ensure_built(tuple(ops), accelerator=dsops.accelerator_for(backend))
    with contextlib.ExitStack() as stack:
        if dsops.ASYNC_IO_OP in ops:  # made after the build, so a failed build leaves no folder behind
            nvme_dir = str(stack.enter_context(temporary_folder("labkit-nvme-", nvme_offload.nvme_parent_dir())))
        fab = stack.enter_context(fabric.Fabric(zero_traffic.topology(ranks))) if on_links else None
        per_rank = launch(probe_rank, ranks, backend=backend, timeout_s=timeout_s, fabric=fab,
                          configs=configs, size=size, dtype=dtype, nvme_dir=nvme_dir, fab=fab,
                          traffic=prof.pick(zero_traffic.SIZES) if on_links else None)
    return [rank_results[i] for i in range(len(configs)) for rank_results in per_rank]


OFFLOAD_TIMING_CONFIGS = BASE_CONFIGS[2:] + CPU_OFFLOAD_CONFIGS


def slowest_best_step_ms(measurements: Iterable[RankMeasurement], name: str) -> float:
    """A configuration's fastest step on its slowest rank: a step ends when the last rank does."""
    steps = [m.best_step_ms for m in measurements if m.config.name == name]
    if not steps:
        raise ValueError(f"no measurement of configuration {name!r}")
    return max(steps)


def offload_slowdowns(measurements: Sequence[RankMeasurement]) -> dict[str, float]:
    """Each offloaded configuration's step time over the same stage without offload.

    Above 1 means offload made the step slower. Only meaningful where the ranks
    are GPUs: on CPU ranks host and "accelerator" are one RAM and no bus is crossed.
    """
    configs = {m.config.name: m.config for m in measurements}
    return {
        name: slowest_best_step_ms(measurements, name)
        / slowest_best_step_ms(measurements, f"stage {config.stage}")
        for name, config in configs.items() if config.offloaded
    }


def predicted(measurement: RankMeasurement) -> zero.ModelStateBytes:
    """labkit.zero's per-rank prediction for the configuration a measurement ran."""
    return zero.model_state_bytes(measurement.num_params, measurement.config.stage,
                                  measurement.dp_degree)


def relative_error(measured: zero.ModelStateBytes, model: zero.ModelStateBytes) -> float:
    """|measured - model| / model over total model-state bytes."""
    return abs(measured.total - model.total) / model.total
