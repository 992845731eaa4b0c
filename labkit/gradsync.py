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
real ranks with real DDP. Where :func:`labkit.fabric.probe` allows, each rank
sits on its own node of a :class:`labkit.fabric.Fabric` and gloo's bytes cross a
real link shaped to the rate under test: the time is measured, and the kernel
counts the bytes. Elsewhere (no root, macOS, Binder, or ``LABKIT_FABRIC=emulated``)
the link is emulated: ``CommCounter`` sleeps the ring model's time for the
counted bytes, so the throughput then follows from the model and is not evidence
for it. Which one runs, and why, is :mod:`labkit.gradsync_links`. The model each measured
row is set beside, and the table and plot that show both, are :mod:`labkit.gradsync_model`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from labkit.collectives import CommCounter, register_counting_hook
from labkit.gradsync_links import LinkMode, emulated_link, launch_over_links, link_mode, set_link_rate, uplink_bytes
from labkit.gradsync_model import MODES, UNSHAPED_GBIT, GradSyncResult, gradsync_result, ms_per_sample
from labkit.gradsync_workload import GradSyncSizes, check_accumulation, make_model, micro_batches, param_bytes


SIZES = {
    # 4.2 MB of fp32 gradients: one all-reduce between 2 nodes sends 4.2 MB each way,
    # ~340 ms at 0.1 Gbit/s, so syncing every micro-step for 4 steps costs ~5.4 s there.
    # Accumulating 4 micro-batches shows what 8 did (the same ms per sample when every micro-step
    # syncs, 44 vs 45 ms at 0.1 Gbit/s) and the experiment takes 19.8 s instead of 26.6 s.
    "ci": GradSyncSizes(hidden=512, layers=4, micro_batch=4, accumulation=4, optimizer_steps=3, warmup_steps=1),
    "gpu": GradSyncSizes(hidden=512, layers=4, micro_batch=4, accumulation=4, optimizer_steps=3, warmup_steps=1),
    "multi-gpu": GradSyncSizes(hidden=1024, layers=4, micro_batch=8, accumulation=16, optimizer_steps=4,
                               warmup_steps=1),
}

RATES_GBIT = (0.1, 0.5, 4.0, UNSHAPED_GBIT)
"""Link rates Lab 5 measures, Gbit/s each way; the last is effectively unshaped (:data:`UNSHAPED_GBIT`)."""


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


def train_rank(
    rates_gbit: Sequence[float],
    hidden: int,
    layers: int,
    micro_batch: int,
    accumulation: int,
    optimizer_steps: int,
    warmup_steps: int,
    links: dict[str, Any] | None = None,
    deepspeed_stages: Sequence[int] = (),
    deepspeed_accumulation: int = 4,
    diagnose_rate_gbit: float | None = None,
    diagnose_dir: str | None = None,
) -> dict[str, Any]:
    """Rank function: one rank alone, then both DDP modes at every link rate, then DeepSpeed's counts, then
    (with ``diagnose_rate_gbit``) both modes again at that rate under ``labkit.diagnose``, traces in ``diagnose_dir``.

    A plain dictionary crosses the pipe; :func:`run_experiment` makes every rank's one :class:`GradSyncResult`.

    With ``links`` (a fabric's ``links``), rank 0 reshapes the real links before
    each rate; without, the counter sleeps the modelled time (emulation). One
    launch runs everything because each launch costs seconds of imports. Rank 0
    first trains alone (no communication) on the same accumulation window while
    the others wait, giving the single-device time to compare against.
    """
    from labkit.launcher import rank_device, rank_info

    info = rank_info()
    started = time.perf_counter()
    device = rank_device()
    rank, world_size = info.rank, info.world_size
    sizes = GradSyncSizes(hidden, layers, micro_batch, accumulation, optimizer_steps, warmup_steps)
    result: dict[str, Any] = {"rank": rank, "world_size": world_size}
    if rank == 0:
        result["single_device"] = _single_device(sizes, device)
    dist.barrier()

    model = make_model(hidden, layers).to(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    counter = CommCounter()
    register_counting_hook(ddp, counter)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    result["gradient_bytes"] = param_bytes(model)
    _use_rate(max(rates_gbit), links, counter, rank)   # the check does not depend on the rate: run it where it is cheap
    result["same_update_max_diff"] = _update_difference(ddp, optimizer, micro_batches(rank, 0, 4, micro_batch, hidden, device))
    rows = []
    # In the given order (slowest first in the lab), each mode warming up at every rate. Run fastest first with
    # one warm-up in all, the diagnosis that follows at 0.5 Gbit/s (after the 0.1 Gbit/s rows) found delayed
    # sync's communication at 0.94-1.41x the ring model in twenty runs, five outside its band; 0.93-1.04 in twenty
    # runs in this order.
    for rate_gbit in rates_gbit:
        _use_rate(rate_gbit, links, counter, rank)
        for mode in MODES:
            rows.append({"rate_gbit": rate_gbit, "mode": mode, "accumulation": accumulation,
                         **_measure_mode(STEP_FNS[mode], ddp, optimizer, counter, sizes, device, rank, world_size)})
    result["rows"] = rows
    if diagnose_rate_gbit is not None:
        from labkit.gradsync_diagnosis import diagnose_modes

        _use_rate(diagnose_rate_gbit, links, counter, rank)
        steps = {mode: (lambda i, fn=fn: fn(ddp, optimizer, sizes.batches(rank, i, device)))
                 for mode, fn in STEP_FNS.items()}
        result["diagnoses"] = diagnose_modes(steps, Path(diagnose_dir), rank)
    if deepspeed_stages:
        from labkit.gradsync_deepspeed import deepspeed_counts

        if links is not None and rank == 0:
            set_link_rate(links, max(rates_gbit))
        dist.barrier()
        result["deepspeed"] = deepspeed_counts(deepspeed_stages, deepspeed_accumulation, hidden, layers, micro_batch)
    result["wall_s"] = time.perf_counter() - started
    return result


def _use_rate(rate_gbit: float, links: dict[str, Any] | None, counter: CommCounter, rank: int) -> None:
    """The link at ``rate_gbit`` from here on: rank 0 reshapes the real links, or the counter sleeps the model's time."""
    if links is not None and rank == 0:
        set_link_rate(links, rate_gbit)
    counter.link = None if links is not None else emulated_link(rate_gbit)


def _single_device(sizes: GradSyncSizes, device: torch.device) -> dict[str, float]:
    """Rank 0 alone, no communication: the step time data parallelism is measured against."""
    model = make_model(sizes.hidden, sizes.layers).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    step_s, _ = _time_steps(lambda i: _local_step(model, optimizer, sizes.batches(0, i, device)),
                            sizes.warmup_steps, sizes.optimizer_steps, device)
    return {"step_s": step_s, "ms_per_sample": ms_per_sample(step_s, 1, sizes.accumulation, sizes.micro_batch)}


def _measure_mode(step_fn: Callable[..., float], ddp: nn.Module, optimizer: torch.optim.Optimizer,
                  counter: CommCounter, sizes: GradSyncSizes, device: torch.device, rank: int,
                  world_size: int) -> dict[str, float]:
    """Time one sync mode at the current link rate; the slowest rank's step time, and per-step byte counts.

    The counter and the uplink's kernel counters are read from the first measured
    step on, so warm-up traffic is not counted.
    """
    bytes_before: list[tuple[int, int]] = []

    def measure_start() -> None:
        counter.reset()
        dist.barrier()
        bytes_before.append(uplink_bytes())

    dist.barrier()
    step_s, losses = _time_steps(lambda i: step_fn(ddp, optimizer, sizes.batches(rank, i, device)),
                                 sizes.warmup_steps, sizes.optimizer_steps, device, on_measure_start=measure_start)
    # A collective returns while its last bytes may still sit in a socket buffer; the barrier's
    # message follows them on the same connection, so after it every byte has crossed the link.
    dist.barrier()
    tx_bytes, wire_bytes = (after - before for after, before in zip(uplink_bytes(), bytes_before[0]))
    slowest = torch.tensor([step_s], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    step_s = slowest.item()
    counts = counter.counts["all_reduce"]
    steps = sizes.optimizer_steps
    return {
        "step_s": step_s,
        "ms_per_sample": ms_per_sample(step_s, world_size, sizes.accumulation, sizes.micro_batch),
        "all_reduce_calls_per_step": counts.calls / steps,
        "all_reduce_bytes_per_step": counts.message_bytes / steps,
        "ring_bytes_per_step": counts.ring_bytes / steps,
        "tx_bytes_per_step": tx_bytes / steps,
        "wire_bytes_per_step": wire_bytes / steps,
        "emulated_s_per_step": counter.emulated_s / steps,
        "final_loss": losses[-1],
    }


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


def run_experiment(
    world_size: int = 2,
    rates_gbit: Sequence[float] = RATES_GBIT,
    deepspeed_stages: Sequence[int] = (1, 2),
    deepspeed_accumulation: int = 4,
    sizes: GradSyncSizes | None = None,
    timeout_s: float = 300.0,
    mode: LinkMode | None = None,
    diagnose_rate_gbit: float | None = None,
) -> GradSyncResult:
    """Launch :func:`train_rank` on ``world_size`` ranks, one per node, over links at each rate.

    With ``diagnose_rate_gbit`` (on real links only: under the emulation gloo's time is a sleep the profiler
    does not call communication) each mode is profiled again at that rate by ``labkit.diagnose``; the result's
    ``diagnoses`` hold each rank's (:mod:`labkit.gradsync_diagnosis`).

    Real shaped links when :func:`link_mode` says ``"namespaces"`` (one fabric,
    reshaped per rate), else the sleep emulation. Returns rank 0's measurements
    with every rank's byte counts, the mode, and the model's prediction beside
    each row (:func:`labkit.gradsync_model.gradsync_result`). Validates every
    argument before any rank starts.
    """
    from labkit import dsops
    from labkit.profiles import profile

    if world_size < 2:
        raise ValueError(f"world_size must be >= 2 for data parallelism over a link, got {world_size}")
    rates = tuple(rates_gbit)
    if not rates or not all(rate > 0 for rate in rates):
        raise ValueError(f"rates_gbit must be one or more rates > 0 in Gbit/s, got {rates_gbit!r}")
    check_accumulation(deepspeed_accumulation)
    from labkit.gradsync_deepspeed import deepspeed_config

    prof = profile()
    backend = prof.backend_for(world_size)
    chosen = sizes or prof.pick(SIZES)
    for stage in deepspeed_stages:
        deepspeed_config(stage, deepspeed_accumulation, chosen.micro_batch)
    if deepspeed_stages:
        dsops.ensure_built(accelerator=dsops.accelerator_for(backend))
    if diagnose_rate_gbit is not None and not diagnose_rate_gbit > 0:
        raise ValueError(f"diagnose_rate_gbit must be a rate > 0 in Gbit/s, got {diagnose_rate_gbit!r}")
    mode = mode or link_mode(backend)
    diagnose_rate_gbit = diagnose_rate_gbit if mode.mode == "namespaces" else None
    kwargs = dict(rates_gbit=rates, deepspeed_stages=tuple(deepspeed_stages),
                  deepspeed_accumulation=deepspeed_accumulation, diagnose_rate_gbit=diagnose_rate_gbit,
                  **dataclasses.asdict(chosen))
    with tempfile.TemporaryDirectory(prefix="labkit-gradsync-diagnose-") as traces:
        results = launch_over_links(train_rank, world_size, rates[0], mode, backend=backend, timeout_s=timeout_s,
                                    diagnose_dir=traces, **kwargs)
    result = gradsync_result(results, chosen, mode)
    if diagnose_rate_gbit is None:
        return result
    return dataclasses.replace(result, diagnoses=tuple(r["diagnoses"] for r in results),
                               diagnose_rate_gbit=diagnose_rate_gbit)
