"""ZeRO's memory model: what one data-parallel rank holds, stage by stage.

Mixed-precision Adam keeps, per parameter, 2 bytes of 16-bit weights, 2 bytes of
16-bit gradients and K = 12 bytes of optimizer state (fp32 master weights,
momentum and variance): 16 bytes that plain data parallelism replicates on every
rank. ZeRO (Rajbhandari et al., arXiv 1910.02054) removes the replication one
state at a time: stage 1 partitions the optimizer state over the N ranks, stage 2
the gradients too, stage 3 the parameters as well. ZeRO-Offload (arXiv
2101.06840) and ZeRO-Infinity (SC21) then move partitions off the accelerator,
to CPU memory or NVMe, which makes a model *fit* but adds traffic over PCIe and
NVMe every step: possible is not the same as faster.

Everything here is a pure function of sizes, so the widget, the notebook and the
tests call the same code. Partitions are rounded up to whole elements, as
DeepSpeed pads its flat buffers to split evenly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

STAGES = (0, 1, 2, 3)
OFFLOAD_TARGETS = ("none", "cpu", "nvme")
STATE_KEYS = ("params", "grads", "optimizer", "total")


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of parameters, gradients and optimizer state held in one place."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def __getitem__(self, key: str) -> int:
        if key not in STATE_KEYS:
            raise KeyError(f"key must be one of {STATE_KEYS}, got {key!r}")
        return getattr(self, key)

    def keys(self) -> tuple[str, ...]:
        return STATE_KEYS

    def __iter__(self) -> Iterator[str]:
        return iter(STATE_KEYS)

    def as_dict(self) -> dict[str, int]:
        return {key: self[key] for key in STATE_KEYS}


ZERO_BYTES = ModelStateBytes(0, 0, 0)


def _check_sizes(num_params: int, stage: int, dp_degree: int, **byte_counts: int) -> None:
    if num_params < 0:
        raise ValueError(f"num_params must be >= 0, got {num_params}")
    if stage not in STAGES:
        raise ValueError(f"stage must be one of 0, 1, 2, 3 (ZeRO stages), got {stage}")
    if dp_degree < 1:
        raise ValueError(f"dp_degree must be >= 1, got {dp_degree}")
    for name, value in byte_counts.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")


def partition_numel(num_params: int, dp_degree: int) -> int:
    """Elements of one rank's partition: the flat buffer is padded to split evenly."""
    return -(-num_params // dp_degree)


def model_state_bytes(
    num_params: int,
    stage: int,
    dp_degree: int,
    *,
    param_bytes: int = 2,
    grad_bytes: int = 2,
    optimizer_bytes: int = 12,
) -> ModelStateBytes:
    """Per-rank bytes of each model state at ZeRO ``stage`` over ``dp_degree`` ranks.

    Stage 0 is plain data parallelism: every rank holds everything. Stage s >= 1
    divides the optimizer state by N, s >= 2 the gradients, s = 3 the parameters.
    """
    _check_sizes(
        num_params, stage, dp_degree,
        param_bytes=param_bytes, grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes,
    )
    part = partition_numel(num_params, dp_degree)
    return ModelStateBytes(
        params=param_bytes * (part if stage >= 3 else num_params),
        grads=grad_bytes * (part if stage >= 2 else num_params),
        optimizer=optimizer_bytes * (part if stage >= 1 else num_params),
    )


@dataclass(frozen=True)
class OffloadPlacement:
    """Where one rank's model states live, and what crosses the links every step.

    ``pcie_bytes_per_step`` counts host<->accelerator traffic of one rank;
    ``nvme_bytes_per_step`` counts reads plus writes of that rank's NVMe state.
    """

    accelerator: ModelStateBytes
    cpu: ModelStateBytes
    nvme: ModelStateBytes
    pcie_bytes_per_step: int
    nvme_bytes_per_step: int

    @property
    def offloaded(self) -> ModelStateBytes:
        """Everything that left the accelerator (CPU plus NVMe)."""
        return ModelStateBytes(
            self.cpu.params + self.nvme.params,
            self.cpu.grads + self.nvme.grads,
            self.cpu.optimizer + self.nvme.optimizer,
        )


def _check_target(name: str, target: str) -> None:
    if target not in OFFLOAD_TARGETS:
        raise ValueError(f"{name} must be one of {OFFLOAD_TARGETS}, got {target!r}")


def offload_placement(
    num_params: int,
    stage: int,
    dp_degree: int,
    *,
    optimizer_target: str = "none",
    param_target: str = "none",
    param_bytes: int = 2,
    grad_bytes: int = 2,
    optimizer_bytes: int = 12,
) -> OffloadPlacement:
    """Split one rank's ZeRO model states between accelerator, CPU and NVMe.

    Optimizer offload (ZeRO-Offload, stages 1-3) moves the optimizer partition off
    the accelerator; the optimizer then runs on the CPU, so the rank's reduced
    gradient partition goes down to host memory (as the paper's fp16 gradients;
    at stage 1 the accelerator still holds every gradient until the reduction)
    and its updated 16-bit parameter partition comes back up. Parameter offload
    (ZeRO-Infinity, stage 3 only) keeps the 16-bit partition off the accelerator
    and fetches it for the forward and again for the backward pass. NVMe states
    are staged through CPU memory, so they cross PCIe as well.
    """
    _check_target("optimizer_target", optimizer_target)
    _check_target("param_target", param_target)
    on_rank = model_state_bytes(
        num_params, stage, dp_degree,
        param_bytes=param_bytes, grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes,
    )
    _check_offload_stage(stage, optimizer_target, param_target)
    part = partition_numel(num_params, dp_degree)
    places = {"none": [0, 0, 0], "cpu": [0, 0, 0], "nvme": [0, 0, 0]}
    places[param_target][0] += on_rank.params
    places[optimizer_target][2] += on_rank.optimizer
    grads_to_cpu = grad_bytes * part if optimizer_target != "none" else 0
    places["cpu"][1] += grads_to_cpu
    places["none"][1] += on_rank.grads - (grads_to_cpu if stage >= 2 else 0)
    pcie, nvme = _offload_traffic_bytes(part, optimizer_target, param_target, param_bytes, grad_bytes,
                                        optimizer_bytes)
    return OffloadPlacement(
        accelerator=ModelStateBytes(*places["none"]),
        cpu=ModelStateBytes(*places["cpu"]),
        nvme=ModelStateBytes(*places["nvme"]),
        pcie_bytes_per_step=pcie,
        nvme_bytes_per_step=nvme,
    )


def _check_offload_stage(stage: int, optimizer_target: str, param_target: str) -> None:
    """Offload moves a rank's *partition*, so it needs the stage that makes that partition."""
    if optimizer_target != "none" and stage < 1:
        raise ValueError(
            f"optimizer_target={optimizer_target!r} needs stage >= 1 (offload moves the rank's "
            f"optimizer partition), got stage {stage}"
        )
    if param_target != "none" and stage < 3:
        raise ValueError(
            f"param_target={param_target!r} needs stage 3 (only stage 3 partitions parameters), "
            f"got stage {stage}"
        )


def _offload_traffic_bytes(
    part: int, optimizer_target: str, param_target: str, param_bytes: int, grad_bytes: int, optimizer_bytes: int
) -> tuple[int, int]:
    """(PCIe, NVMe) bytes one rank moves per step for its partition of ``part`` elements.

    PCIe: gradients down and updated parameters up for a CPU optimizer; offloaded
    parameters come up for the forward and the backward (and go down once more when
    the optimizer stays on the accelerator). NVMe: optimizer state is read and
    written back every step; offloaded parameters are read twice and written once.
    """
    pcie = 0
    if optimizer_target != "none":
        pcie += grad_bytes * part
        if param_target == "none":
            pcie += param_bytes * part
    if param_target != "none":
        pcie += 2 * param_bytes * part
        if optimizer_target == "none":
            pcie += param_bytes * part
    nvme = 0
    if optimizer_target == "nvme":
        nvme += 2 * optimizer_bytes * part
    if param_target == "nvme":
        nvme += 3 * param_bytes * part
    return pcie, nvme


def largest_model_params(
    device_bytes: int,
    stage: int,
    dp_degree: int,
    *,
    optimizer_target: str = "none",
    param_target: str = "none",
    param_bytes: int = 2,
    grad_bytes: int = 2,
    optimizer_bytes: int = 12,
) -> int:
    """The most parameters whose model states fit ``device_bytes`` of accelerator memory per rank.

    Activations, communication buckets and fragmentation are not model states and
    are not counted: this is an upper bound. With everything offloaded the
    accelerator holds no persistent model state, and the limit moves to CPU memory
    or NVMe capacity, which this function does not model: it raises.
    """
    if device_bytes < 0:
        raise ValueError(f"device_bytes must be >= 0, got {device_bytes}")
    kwargs = dict(optimizer_target=optimizer_target, param_target=param_target,
                  param_bytes=param_bytes, grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes)
    # The model is linear in the parameter count, and dp_degree parameters partition
    # exactly, so they give the slope; the searches below settle the rounding.
    per_param = offload_placement(dp_degree, stage, dp_degree, **kwargs).accelerator.total / dp_degree
    if per_param <= 0:
        raise ValueError(
            "with every model state offloaded the accelerator bound is infinite; "
            "size the model by CPU memory or NVMe capacity instead"
        )
    best = int(device_bytes / per_param)
    while best > 0 and offload_placement(best, stage, dp_degree, **kwargs).accelerator.total > device_bytes:
        best -= 1
    while offload_placement(best + 1, stage, dp_degree, **kwargs).accelerator.total <= device_bytes:
        best += 1
    return best


OFFLOAD_CHOICES = {
    "none": ("none", "none"),
    "optimizer -> CPU": ("cpu", "none"),
    "optimizer + params -> CPU": ("cpu", "cpu"),
    "optimizer + params -> NVMe": ("nvme", "nvme"),
}


@dataclass(frozen=True)
class CalculatorView:
    """What the calculator shows: per-rank bars, whether it fits, and why."""

    labels: tuple[str, ...]
    accelerator_gib: tuple[float, ...]
    offloaded_gib: tuple[float, ...]
    device_gib: float
    fits: bool
    pcie_gib_per_step: float
    nvme_gib_per_step: float
    message: str


GIB = 2**30


def calculator_view(
    num_params: float,
    dp_degree: int,
    stage: int,
    offload: str,
    device_gib: float,
) -> CalculatorView:
    """The calculator's logic: sizes in, bars and a verdict out (the widget only draws this)."""
    if offload not in OFFLOAD_CHOICES:
        raise ValueError(f"offload must be one of {tuple(OFFLOAD_CHOICES)}, got {offload!r}")
    if device_gib <= 0:
        raise ValueError(f"device_gib must be > 0, got {device_gib}")
    optimizer_target, param_target = OFFLOAD_CHOICES[offload]
    if optimizer_target != "none" and stage < 1:
        stage_note = f"offload needs stage >= 1; showing stage {max(stage, 1)}"
        stage = max(stage, 1)
    else:
        stage_note = ""
    if param_target != "none" and stage < 3:
        stage_note = "parameter offload needs stage 3; showing stage 3"
        stage = 3
    placed = offload_placement(
        int(num_params), stage, dp_degree,
        optimizer_target=optimizer_target, param_target=param_target,
    )
    labels = ("params", "grads", "optimizer")
    on_acc = tuple(placed.accelerator[k] / GIB for k in labels)
    off = tuple(placed.offloaded[k] / GIB for k in labels)
    used_gib = placed.accelerator.total / GIB
    fits = used_gib <= device_gib
    verdict = "fits" if fits else "does NOT fit"
    message = (
        f"stage {stage}, {dp_degree} ranks: {used_gib:.2f} GiB of model states per rank on the "
        f"accelerator, {placed.offloaded.total / GIB:.2f} GiB offloaded; {verdict} in {device_gib:g} GiB "
        f"(before activations and buffers). Per step: {placed.pcie_bytes_per_step / GIB:.2f} GiB over PCIe, "
        f"{placed.nvme_bytes_per_step / GIB:.2f} GiB to/from NVMe."
    )
    if stage_note:
        message = f"{stage_note}. {message}"
    return CalculatorView(
        labels=labels,
        accelerator_gib=on_acc,
        offloaded_gib=off,
        device_gib=float(device_gib),
        fits=fits,
        pcie_gib_per_step=placed.pcie_bytes_per_step / GIB,
        nvme_gib_per_step=placed.nvme_bytes_per_step / GIB,
        message=message,
    )


def calculator_figure(view: CalculatorView):
    """The calculator's picture: per-rank GiB on the accelerator and offloaded, with the verdict."""
    from labkit import plots

    fig, (ax,) = plots.figure(width=6.5, height=3.2)
    x = range(len(view.labels))
    ax.bar(x, view.accelerator_gib, color=plots.FIX, label="on the accelerator")
    ax.bar(x, view.offloaded_gib, bottom=view.accelerator_gib, color=plots.BASELINE,
           hatch="//", label="offloaded (CPU/NVMe)")
    ax.set_xticks(list(x), view.labels)
    ax.set_ylabel("GiB per rank")
    ax.set_title(("fits" if view.fits else "does not fit") + f" in {view.device_gib:g} GiB",
                 color=plots.GOOD if view.fits else plots.WARN)
    ax.legend()
    return fig


def calculator():
    """Controls over :func:`calculator_view` (all logic lives there; see :mod:`labkit.widgets`)."""
    import ipywidgets as widgets

    from labkit.widgets import live

    controls = {
        "billions": widgets.FloatLogSlider(value=7.5, base=10, min=-1, max=3, step=0.05, description="params (B)"),
        "ranks": widgets.IntSlider(value=64, min=1, max=1024, description="ranks"),
        "stage": widgets.Dropdown(options=list(STAGES), value=3, description="ZeRO stage"),
        "offload": widgets.Dropdown(options=list(OFFLOAD_CHOICES), value="none", description="offload"),
        "memory_gib": widgets.FloatSlider(value=80, min=8, max=192, step=8, description="GiB/device"),
    }

    def render(billions: float, ranks: int, stage: int, offload: str, memory_gib: float):
        view = calculator_view(billions * 1e9, ranks, stage, offload, memory_gib)
        return calculator_figure(view), view.message

    return live(render, controls, rows=[["billions", "ranks", "stage"], ["offload", "memory_gib"]])
