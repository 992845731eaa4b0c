"""What DeepSpeed's ZeRO stages send during gradient accumulation: its collectives, counted per step.

Lab 5's fix (sync once per accumulation window) is what DeepSpeed does with
``gradient_accumulation_steps``; this module checks that by counting the
collectives a real DeepSpeed engine issues per micro-step and per optimizer step,
stage by stage, on the same model and data as :mod:`labkit.gradsync`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch.distributed as dist
from torch import nn

from labkit.collectives import CommCounter
from labkit.gradsync_workload import check_accumulation, make_model, micro_batches, param_bytes


@dataclass(frozen=True)
class DeepSpeedCounts:
    """The collectives one ZeRO stage issued: per optimizer step (calls and bytes, by op) and per micro-step.

    Keyed by op name (``"all_reduce"``, ``"all_gather"``, ...) because which ops a
    stage issues is what the lab looks at; ops it never issued are left out.
    """

    stage: int
    accumulation: int
    parameter_bytes: int
    calls_per_optimizer_step: dict[str, int]
    message_bytes_per_optimizer_step: dict[str, int]
    ring_bytes_per_optimizer_step: dict[str, int]
    calls_per_micro_step: list[dict[str, int]]


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


def deepspeed_counts(
    stages: Sequence[int], accumulation: int, hidden: int, layers: int, micro_batch: int
) -> list[DeepSpeedCounts]:
    """Count the collectives DeepSpeed issues per micro-step and per optimizer step, stage by stage.

    The counter is active before ``deepspeed.init_distributed``: DeepSpeed's comm
    backend binds ``torch.distributed.all_gather_into_tensor`` (and the
    reduce-scatter) once, when it is created, so a counter started later never
    sees stages 1-2's all-gather of the updated parameters. DeepSpeed creates that
    backend once per process, so one counter serves every stage.
    """
    import deepspeed

    with CommCounter() as counter:
        deepspeed.init_distributed(dist_backend=dist.get_backend())
        return [stage_counts(counter, stage, accumulation, hidden, layers, micro_batch) for stage in stages]


def stage_counts(
    counter: CommCounter, stage: int, accumulation: int, hidden: int, layers: int, micro_batch: int
) -> DeepSpeedCounts:
    import deepspeed

    model = make_model(hidden, layers)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=deepspeed_config(stage, accumulation, micro_batch)
    )
    rank = dist.get_rank()
    per_micro_step: list[dict[str, int]] = []
    for step in range(2):
        if step == 1:
            counter.reset()
        for x, y in micro_batches(rank, step, accumulation, micro_batch, hidden, engine.device):
            before = {op: c.calls for op, c in counter.counts.items()}
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
            if step == 1:
                per_micro_step.append({op: c.calls - before[op] for op, c in counter.counts.items() if c.calls - before[op]})
    del engine
    issued = {op: c for op, c in counter.counts.items() if c.calls}
    return DeepSpeedCounts(
        stage=stage,
        accumulation=accumulation,
        parameter_bytes=param_bytes(model),
        calls_per_optimizer_step={op: c.calls for op, c in issued.items()},
        message_bytes_per_optimizer_step={op: c.message_bytes for op, c in issued.items()},
        ring_bytes_per_optimizer_step={op: c.ring_bytes for op, c in issued.items()},
        calls_per_micro_step=per_micro_step,
    )


def print_stage_counts(counts: Sequence[DeepSpeedCounts]) -> None:
    """Each stage's collectives, per micro-step of one window, then per optimizer step with their bytes."""
    for ds in counts:
        print(f"ZeRO stage {ds.stage}: per micro-step {ds.calls_per_micro_step}; "
              f"per optimizer step {ds.calls_per_optimizer_step}, bytes {ds.message_bytes_per_optimizer_step}")
