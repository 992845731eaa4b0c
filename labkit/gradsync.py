"""Data-parallel training: synchronise gradients every micro-step, or once per window.

Rajbhandari's 2019 story (REFERENCES.md, Lab 5): BERT-Large on 64 GPUs over
4 Gbps Ethernet ran slower than expected until gradients were accumulated over
16 micro-batches before synchronising. The physics: a data-parallel step pays
one gradient all-reduce of the whole model, whatever the batch; if it syncs
after every small micro-batch, the link, not the compute, sets the pace. Syncing
only at the end of the accumulation window (``DDP.no_sync`` for the other
micro-steps, or DeepSpeed's ``gradient_accumulation_steps``) divides the number
of all-reduces by the accumulation factor while leaving the maths unchanged.

``sync_every_micro_step`` is the baseline, ``delayed_sync`` the fix; both run on
real ranks with real DDP, and the link is emulated (``labkit.collectives``) so
two local processes behave like two nodes on a slow network.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from labkit.collectives import LINKS, CommCounter, register_counting_hook, ring_bytes_per_rank

SIZES = {
    "ci": {"hidden": 512, "layers": 4, "micro_batch": 4, "accumulation": 8, "optimizer_steps": 4, "warmup_steps": 1},
    "gpu": {"hidden": 512, "layers": 4, "micro_batch": 4, "accumulation": 8, "optimizer_steps": 4, "warmup_steps": 1},
    # 17 MB of gradients: at the emulated 1 Gbps link the ring model gives ~0.24 s per
    # all-reduce on 8 ranks, and syncing every micro-step makes ~85 of them, inside the timeout.
    "multi-gpu": {"hidden": 1024, "layers": 4, "micro_batch": 8, "accumulation": 16, "optimizer_steps": 4, "warmup_steps": 1},
}

MODES = ("sync_every_micro_step", "delayed_sync")


def check_accumulation(accumulation: int) -> None:
    if not isinstance(accumulation, int) or accumulation < 1:
        raise ValueError(f"accumulation must be an integer >= 1, got {accumulation!r}")


def make_model(hidden: int, layers: int, seed: int = 0) -> nn.Sequential:
    """A stack of Linear+ReLU blocks: parameters (hence gradient bytes) scale as layers x hidden^2."""
    if hidden < 1 or layers < 1:
        raise ValueError(f"hidden and layers must be >= 1, got {hidden}, {layers}")
    torch.manual_seed(seed)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(*blocks[:-1])


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def micro_batches(
    rank: int, step: int, accumulation: int, micro_batch: int, hidden: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Synthetic regression data, different on every rank and step (each rank sees its own shard)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    out = []
    for _ in range(accumulation):
        x = torch.randn(micro_batch, hidden, generator=gen)
        out.append((x.to(device), x.flip(1).to(device)))
    return out


def sync_every_micro_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> float:
    """Baseline: DDP all-reduces the gradients after every micro-batch's backward."""
    return _accumulate(model, optimizer, batches, skip_sync=lambda last: contextlib.nullcontext())


def delayed_sync(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> float:
    """The fix: ``no_sync`` for all but the last micro-batch, so one all-reduce per window.

    Gradients still accumulate locally in ``.grad``; the last backward all-reduces
    the sum, so the update is the same as syncing every time.
    """
    return _accumulate(
        model, optimizer, batches, skip_sync=lambda last: contextlib.nullcontext() if last else model.no_sync()
    )


def _accumulate(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    skip_sync: Callable[[bool], Any],
) -> float:
    total = 0.0
    for i, (x, y) in enumerate(batches):
        with skip_sync(i == len(batches) - 1):
            loss = nn.functional.mse_loss(model(x), y) / len(batches)
            loss.backward()
        total += loss.item()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


STEP_FNS = {"sync_every_micro_step": sync_every_micro_step, "delayed_sync": delayed_sync}


def _local_step(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Sequence) -> float:
    return _accumulate(model, optimizer, batches, skip_sync=lambda last: contextlib.nullcontext())


def _time_steps(step: Callable[[int], float], warmup_steps: int, optimizer_steps: int, device: torch.device,
                on_measure_start: Callable[[], None] = lambda: None) -> tuple[float, list[float]]:
    """Seconds of the fastest measured optimizer step, and all losses.

    The fastest step, because on a shared machine contention only ever adds time;
    every measured step still does the same communication (the counts cover all).
    """
    from labkit.devices import synchronize

    losses = []
    for i in range(warmup_steps):
        losses.append(step(i))
    synchronize(device)
    on_measure_start()
    step_s = []
    for i in range(warmup_steps, warmup_steps + optimizer_steps):
        start = time.perf_counter()
        losses.append(step(i))
        synchronize(device)
        step_s.append(time.perf_counter() - start)
    return min(step_s), losses


def experiment_configs(links: Sequence[str | None], accumulation: int) -> list[dict[str, Any]]:
    """Per link: no accumulation, accumulation synced every micro-step, accumulation with delayed sync."""
    check_accumulation(accumulation)
    for name in links:
        if name is not None and name not in LINKS:
            raise ValueError(f"link must be one of {sorted(LINKS)} or None, got {name!r}")
    configs = []
    for name in links:
        configs.append({"link": name, "mode": "sync_every_micro_step", "accumulation": 1})
        configs.append({"link": name, "mode": "sync_every_micro_step", "accumulation": accumulation})
        configs.append({"link": name, "mode": "delayed_sync", "accumulation": accumulation})
    return configs


def ddp_rank(
    configs: Sequence[dict[str, Any]],
    hidden: int,
    layers: int,
    micro_batch: int,
    optimizer_steps: int,
    warmup_steps: int,
    deepspeed_stages: Sequence[int] = (),
    deepspeed_accumulation: int = 4,
) -> dict[str, Any]:
    """Rank function: the one-device baseline, then every DDP config, then DeepSpeed stages.

    One launch runs everything because each launch costs seconds of imports.
    Rank 0 first trains alone (no communication) while the others wait, giving
    the single-device throughput to compare against.
    """
    from labkit.launcher import rank_info

    info = rank_info()
    started = time.perf_counter()
    device = torch.device(info.device)
    rank, world_size = info.rank, info.world_size
    result: dict[str, Any] = {"rank": rank, "world_size": world_size}

    if rank == 0:
        model = make_model(hidden, layers).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        step_s, _ = _time_steps(
            lambda i: _local_step(model, optimizer, micro_batches(0, i, 1, micro_batch, hidden, device)),
            warmup_steps, optimizer_steps, device,
        )
        result["single_device"] = {"step_s": step_s, "samples_per_s": micro_batch / step_s}
    dist.barrier()

    model = make_model(hidden, layers).to(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    counter = CommCounter()
    register_counting_hook(ddp, counter)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    gradient_bytes = param_bytes(model)
    result["same_update_max_diff"] = _update_difference(ddp, optimizer, micro_batches(rank, 0, 4, micro_batch, hidden, device))
    rows = []
    for config in configs:
        accumulation = config["accumulation"]
        check_accumulation(accumulation)
        counter.link = LINKS[config["link"]] if config["link"] else None
        step_fn = STEP_FNS[config["mode"]]
        dist.barrier()
        step_s, losses = _time_steps(
            lambda i: step_fn(ddp, optimizer, micro_batches(rank, i, accumulation, micro_batch, hidden, device)),
            warmup_steps, optimizer_steps, device, on_measure_start=counter.reset,
        )
        slowest = torch.tensor([step_s], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        step_s = slowest.item()
        counts = counter.counts["all_reduce"]
        samples = world_size * accumulation * micro_batch
        rows.append({
            **config,
            "world_size": world_size,
            "step_s": step_s,
            "samples_per_s": samples / step_s,
            "ms_per_sample": 1e3 * step_s / samples,
            "all_reduce_calls_per_step": counts.calls / optimizer_steps,
            "all_reduce_bytes_per_step": counts.message_bytes / optimizer_steps,
            "ring_bytes_per_step": counts.ring_bytes / optimizer_steps,
            "emulated_s_per_step": counter.emulated_s / optimizer_steps,
            "final_loss": losses[-1],
        })
    result["ddp"] = rows
    result["gradient_bytes"] = gradient_bytes
    result["ddp_wall_s"] = time.perf_counter() - started
    if deepspeed_stages:
        result["deepspeed"] = [
            _deepspeed_counts(stage, deepspeed_accumulation, hidden, layers, micro_batch, device)
            for stage in deepspeed_stages
        ]
    result["wall_s"] = time.perf_counter() - started
    return result


def _update_difference(ddp: nn.Module, optimizer: torch.optim.Optimizer, batches: Sequence) -> float:
    """Largest parameter difference after one step of each mode from the same state.

    Delayed sync must change *when* gradients are averaged, not the update: the
    sum of per-micro-batch averages equals the average of the sums.
    """
    start = {k: v.clone() for k, v in ddp.module.state_dict().items()}
    sync_every_micro_step(ddp, optimizer, batches)
    after_every = {k: v.clone() for k, v in ddp.module.state_dict().items()}
    ddp.module.load_state_dict(start)
    delayed_sync(ddp, optimizer, batches)
    diff = max((ddp.module.state_dict()[k] - v).abs().max().item() for k, v in after_every.items())
    ddp.module.load_state_dict(start)
    return diff


def deepspeed_config(stage: int, accumulation: int, micro_batch: int) -> dict[str, Any]:
    """A small-model DeepSpeed config: fp32 (fp16 is refused on CPUs), torch Adam, small buckets."""
    check_accumulation(accumulation)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage}")
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 2**24,
            "allgather_bucket_size": 2**24,
            "stage3_prefetch_bucket_size": 2**20,
            "stage3_param_persistence_threshold": 0,
        },
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


def _deepspeed_counts(
    stage: int, accumulation: int, hidden: int, layers: int, micro_batch: int, device: torch.device
) -> dict[str, Any]:
    """Count the collectives DeepSpeed issues per micro-step and per optimizer step for one stage."""
    import deepspeed

    deepspeed.init_distributed(dist_backend=dist.get_backend())
    model = make_model(hidden, layers)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=deepspeed_config(stage, accumulation, micro_batch)
    )
    rank = dist.get_rank()
    per_micro_step: list[dict[str, int]] = []
    with CommCounter() as counter:
        for step in range(2):
            batches = micro_batches(rank, step, accumulation, micro_batch, hidden, engine.device)
            for x, y in batches:
                before = {op: c.calls for op, c in counter.counts.items()}
                loss = nn.functional.mse_loss(engine(x), y)
                engine.backward(loss)
                engine.step()
                if step == 1:
                    per_micro_step.append({op: c.calls - before[op] for op, c in counter.counts.items() if c.calls - before[op]})
            if step == 0:
                counter.reset()
    del engine
    return {
        "stage": stage,
        "accumulation": accumulation,
        "calls_per_optimizer_step": {op: c.calls for op, c in counter.counts.items() if c.calls},
        "ring_bytes_per_optimizer_step": {op: c.ring_bytes for op, c in counter.counts.items() if c.calls},
        "calls_per_micro_step": per_micro_step,
    }


def run_experiment(
    world_size: int = 2,
    links: Sequence[str | None] = ("1 Gbps", "4 Gbps Ethernet", "100 Gbps", "NVLink-class"),
    deepspeed_stages: Sequence[int] = (0, 1, 2),
    deepspeed_accumulation: int = 4,
    sizes: dict[str, Any] | None = None,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """Launch ``ddp_rank`` on ``world_size`` real ranks; returns rank 0's measurements.

    Validates every argument before any rank starts.
    """
    from labkit import dsops
    from labkit.launcher import launch
    from labkit.profiles import profile

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    check_accumulation(deepspeed_accumulation)
    prof = profile()
    backend = prof.backend_for(world_size)
    chosen = dict(sizes or prof.pick(SIZES))
    configs = experiment_configs(links, chosen.pop("accumulation"))
    if deepspeed_stages:
        for stage in deepspeed_stages:
            deepspeed_config(stage, deepspeed_accumulation, chosen["micro_batch"])
        dsops.ensure_built(accelerator=dsops.accelerator_for(backend))
    return launch(
        ddp_rank, world_size, backend=backend, timeout_s=timeout_s,
        configs=configs, deepspeed_stages=tuple(deepspeed_stages),
        deepspeed_accumulation=deepspeed_accumulation, **chosen,
    )[0]


def predicted_ring_bytes_per_step(gradient_bytes: int, world_size: int, syncs_per_step: int) -> int:
    """What the ring model says one optimizer step's gradient all-reduces send per rank."""
    return syncs_per_step * ring_bytes_per_rank("all_reduce", gradient_bytes, world_size)


def find_row(rows: Sequence[dict[str, Any]], **match: Any) -> dict[str, Any]:
    """The one measurement row whose fields equal ``match``."""
    found = [row for row in rows if all(row.get(k) == v for k, v in match.items())]
    if len(found) != 1:
        raise KeyError(f"expected one row matching {match}, found {len(found)}")
    return found[0]


def scaling_plot(result: dict[str, Any]):
    """Samples/s per link: one device vs N ranks without accumulation vs N ranks with delayed sync."""
    from labkit.plots import BASELINE, FIX, WARN, figure

    rows = result["ddp"]
    links = list(dict.fromkeys(row["link"] for row in rows))
    accumulation = max(row["accumulation"] for row in rows)
    n = result["world_size"]
    fig, (ax,) = figure(1, width=9, height=4.2)
    width = 0.27
    single = result["single_device"]["samples_per_s"]
    no_acc = [find_row(rows, link=l, accumulation=1)["samples_per_s"] for l in links]
    delayed = [find_row(rows, link=l, mode="delayed_sync", accumulation=accumulation)["samples_per_s"] for l in links]
    xs = range(len(links))
    ax.bar([x - width for x in xs], [single] * len(links), width, color=BASELINE, label="1 rank (no communication)")
    ax.bar(list(xs), no_acc, width, color=WARN, label=f"{n} ranks, sync every micro-batch")
    ax.bar([x + width for x in xs], delayed, width, color=FIX, label=f"{n} ranks, delayed sync (accumulate {accumulation})")
    ax.set_xticks(list(xs), [f"{l}\n(emulated)" if l else "loopback" for l in links])
    ax.set_ylabel("samples / s")
    ax.set_title("Data parallelism under emulated links")
    ax.legend(fontsize=8)
    return fig
