"""Which bytes a live DeepSpeed engine holds, sorted into ZeRO's model states.

The probe (:mod:`labkit.zero_probe`) calls :func:`model_state_snapshot` on a real
engine: it walks every tensor the engine and its optimizer reference and sorts the
storage into parameters, gradients, optimizer state and buffers (communication
buckets, which ZeRO calls residual state and are not model states). Each storage
is counted once, however many views point into it.

Where a state lives: on GPU ranks a tensor's device says it. On CPU ranks the
CPU stands in for the accelerator and both sides are the same RAM, so the
snapshot reads DeepSpeed's own placement instead: states of an engine whose
optimizer was offloaded (it then runs DeepSpeed's host-only CPU Adam) count as
host-resident.

Beside the bytes held between steps: what one step adds at its peak
(:func:`step_peak_added_bytes`), and what DeepSpeed's own estimators budget
(:func:`deepspeed_estimates`).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable

ROLES = ("params", "grads", "optimizer", "buffers")
OWN_MAPPING_BYTES = 64 * 1024
"""On CPU ranks, allocations this large get their own mapping while peaks are measured (see step_peak_added_bytes)."""


_BUFFER_PATH = re.compile(r"ipg|bucket|temp_|_for_cpu_offload|_for_gpu_offload|round_robin|meta")


_GRAD_PATH = re.compile(r"grad")


_HOST_GRAD_PATH = re.compile(r"offload|grad_partition")


def _collect(obj: Any, path: str, found: dict[int, tuple[Any, list[str]]], seen: set[int],
             depth: int = 0) -> None:
    """Every tensor reachable from DeepSpeed/torch.optim objects, keyed by storage."""
    import torch

    if isinstance(obj, torch.Tensor):
        if obj.numel() == 0:
            return
        storage = obj.untyped_storage()
        entry = found.setdefault(storage.data_ptr(), (obj, []))
        entry[1].append(path)
        return
    if depth > 8 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        for key, value in obj.items():
            _collect(value, f"{path}[{key if isinstance(key, (str, int)) else type(key).__name__}]",
                     found, seen, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            _collect(value, f"{path}[{index}]", found, seen, depth + 1)
    elif type(obj).__module__.startswith(("deepspeed", "torch.optim")) and hasattr(obj, "__dict__"):
        for key, value in vars(obj).items():
            _collect(value, f"{path}.{key}", found, seen, depth + 1)


def _role(paths: Iterable[str], param_storages: set[int], optimizer_storages: set[int], ptr: int,
          tensor) -> str:
    if ptr in param_storages:
        return "params"
    if ptr in optimizer_storages:
        return "optimizer"
    if tensor.numel() <= 1:
        return "buffers"
    joined = " ".join(paths)
    if "gathered" in joined:
        return "buffers"
    if re.search(r"fp32_partitioned_groups_flat|single_partition_of_fp32", joined) and tensor.dtype.is_floating_point:
        return "optimizer"
    if _BUFFER_PATH.search(joined) and not re.search(r"grad_partitions_flat|param_id_to_grad", joined):
        return "buffers"
    if _GRAD_PATH.search(joined):
        return "grads"
    return "buffers"


def model_state_snapshot(engine) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes per role on the accelerator and on the host, by walking the engine's tensors."""
    found: dict[int, tuple[Any, list[str]]] = {}
    seen: set[int] = set()
    param_storages: set[int] = set()
    for name, param in engine.module.named_parameters():
        partition = getattr(param, "ds_tensor", None)
        if partition is not None and partition.numel() > 0:
            param_storages.add(partition.untyped_storage().data_ptr())
            _collect(partition, f"module.{name}.ds_tensor", found, seen)
        if param.data.numel() > 0:
            if partition is None:
                param_storages.add(param.data.untyped_storage().data_ptr())
            _collect(param.data, f"module.{name}.{'gathered' if partition is not None else 'data'}",
                     found, seen)
        if param.grad is not None:
            _collect(param.grad, f"module.{name}.grad", found, seen)
    basic = engine.basic_optimizer
    optimizer_storages: set[int] = set()
    for group in basic.param_groups:
        for master in group["params"]:
            if master.numel() > 0:
                optimizer_storages.add(master.untyped_storage().data_ptr())
                _collect(master, "optimizer.master", found, seen)
            if master.grad is not None:
                _collect(master.grad, "optimizer.master.grad", found, seen)
    for state in basic.state.values():
        for key, tensor in state.items():
            if hasattr(tensor, "untyped_storage") and tensor.numel() > 1:
                optimizer_storages.add(tensor.untyped_storage().data_ptr())
                _collect(tensor, f"optimizer.state.{key}", found, seen)
    _collect(engine.optimizer, "zero", found, seen)

    wrapper = engine.optimizer
    optimizer_on_host = bool(getattr(wrapper, "cpu_offload", False) or getattr(wrapper, "offload_optimizer", False))
    params_on_host = bool(getattr(wrapper, "offload_param", False))
    accelerator_type = engine.device.type if hasattr(engine.device, "type") else str(engine.device).split(":")[0]
    accelerator = dict.fromkeys(ROLES, 0)
    host = dict.fromkeys(ROLES, 0)
    for ptr, (tensor, paths) in found.items():
        role = _role(paths, param_storages, optimizer_storages, ptr, tensor)
        nbytes = tensor.untyped_storage().nbytes()
        if accelerator_type != "cpu":
            on_host = tensor.device.type == "cpu"
        else:
            on_host = (
                (role == "optimizer" and optimizer_on_host)
                or (role == "params" and params_on_host)
                or (role == "grads" and optimizer_on_host and bool(_HOST_GRAD_PATH.search(" ".join(paths))))
            )
        (host if on_host else accelerator)[role] += nbytes
    return accelerator, host


def elementwise_max(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {key: max(a[key], b[key]) for key in a}


PEAK_STEPS = 3
"""Steps whose peaks are measured; the median is kept (see step_peak_added_bytes)."""


def step_peak_added_bytes(run_step: Callable[[], None], device: str) -> int:
    """Peak memory one step adds above what the rank holds between steps: gathered
    parameters, buckets, temporaries and activations, all at once. One warm-up step,
    then the median of :data:`PEAK_STEPS` measured steps.

    Measured by :func:`labkit.devices.peak_added_bytes`: on GPU ranks the caching
    allocator's peak; on CPU ranks the kernel's resident-set high-water mark, which counts every
    thread's memory: at stage 3 (batch 16) the mark rose 1-4 MB more than the tensors
    torch's profiler saw allocated on the training thread, which is all it follows
    (gloo works on threads of its own); the caller must first give every allocation of
    :data:`OWN_MAPPING_BYTES` or more its own mapping (returned to the kernel when
    freed), so the mark rises by what this step holds at once.

    The peak is a real spread, not only noise: whether a buffer freed by gloo's thread
    is gone before the next one is allocated depends on timing. Seen here (24 x 192 x 192
    layers, bf16, batch 16): one rank's stage-0 peak alternated between 5.2 and 6.2 MB
    from step to step, and stage 3's moved 3.9-5.8 MB within a run; the median of three
    steps keeps one such step from deciding.
    """
    import statistics

    from labkit.devices import peak_added_bytes

    run_step()
    return int(statistics.median(peak_added_bytes(run_step, device) for _ in range(PEAK_STEPS)))


def weigh_one_step(engine, run_step: Callable[[], None]) -> tuple[dict[str, int], dict[str, int]]:
    """Run one step, weighing the engine before the final gradient reduction and after the step; the larger of each.

    The end of the backward pass is the peak of gradient memory (at stages 0-1 every
    gradient is alive there); Adam's moments exist only from the first step on.
    """
    snapshots = []
    reduce = engine.allreduce_gradients

    def snapshot_then_reduce(*args, **kwargs):
        snapshots.append(model_state_snapshot(engine))
        return reduce(*args, **kwargs)

    engine.allreduce_gradients = snapshot_then_reduce
    try:
        run_step()
    finally:
        engine.allreduce_gradients = reduce
    snapshots.append(model_state_snapshot(engine))
    accelerator, host = snapshots[0]
    for acc, hst in snapshots[1:]:
        accelerator, host = elementwise_max(accelerator, acc), elementwise_max(host, hst)
    return accelerator, host


def deepspeed_estimates(num_params: int, largest_layer_params: int, dp_degree: int) -> dict[str, int]:
    """DeepSpeed's own per-GPU estimates (bytes, no offload), for stages 2 and 3.

    They count 18 bytes per partitioned parameter (16-bit plus 32-bit gradients,
    fp32 master, two moments): stage 2 is 2 + 18/N where the paper has 2 + 14/N,
    stage 3 is 18/N where the paper has 16/N, plus 4 bytes per parameter of the
    largest layer for its gathered working copy.
    """
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    _, zero2 = estimate_zero2_model_states_mem_needs(num_params, dp_degree, 1, cpu_offload=False)
    _, zero2_offload = estimate_zero2_model_states_mem_needs(num_params, dp_degree, 1, cpu_offload=True)
    _, zero3, _ = estimate_zero3_model_states_mem_needs(
        num_params, largest_layer_params, dp_degree, 1, cpu_offload=False, cpu_offload_params=False)
    _, zero3_offload, _ = estimate_zero3_model_states_mem_needs(
        num_params, largest_layer_params, dp_degree, 1, cpu_offload=True, cpu_offload_params=True)
    return {"stage 2": zero2, "stage 2 + optimizer->CPU": zero2_offload,
            "stage 3": zero3, "stage 3 + optimizer,params->CPU": zero3_offload}
