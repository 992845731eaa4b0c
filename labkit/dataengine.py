"""The data engine: one Daft pipeline from a catalog selection to a training batch.

Lab 1 found that the accelerator waits on the input path. This module moves the
diagnosis upstream, to how the dataset is *represented* (:mod:`labkit.representations`:
files, packed Parquet, a tensor cache) and which engine reads it.

Daft does the I/O and decoding in native threads. The resize is torch's antialiased
bilinear kernel inside a Daft batch function: in ten runs of Lab 2 on the 2-core CI
box, per image of this course's JPEGs resized to 32 px, Daft's own ``resize`` (the
``image`` crate's triangle filter) cost 0.23-0.29 ms of CPU and torch's uint8 kernel
0.08-0.13 ms, 1.8-2.7x less (:func:`resize_costs` measures them on your machine),
beside a 0.30-0.39 ms decode (:func:`stage_costs`). ``resizer="daft"`` keeps Daft's
resize for comparison. The decode is not where the engine gains: in the same ten runs
Lab 1's PIL worker decoded the same images in 0.27-0.39 ms (:func:`stage_table` sets
the two paths side by side). Daft has no per-sample random augmentation, so
:func:`augment_batch` does it on the whole batch in torch, on the accelerator where
there is one. The same pipeline on a Ray cluster is :mod:`labkit.daft_runners`.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import daft
import numpy as np
import torch
import torch.nn.functional as F
from daft import DataType, col
from daft.functions import image_to_tensor, resize

from labkit.accelerator import Accelerator, accelerator_for
from labkit.devices import cpu_ms_per_item, host_threads
from labkit.ladder import rate_over_loader
from labkit.meter import MeterSummary, StepMeter


@dataclass(frozen=True)
class EngineSizes:
    """One profile's experiment sizes.

    The accelerator has no size here: :func:`make_accelerator` sizes it from the
    decode rate measured on this machine, as Lab 1 does.
    ``latency_ms`` is the object store's first-byte latency per request: an emulated condition
    (:mod:`labkit.objectstore`), since this box has no remote bucket.
    ``stage_images`` caps the images whose stage costs are measured: a per-image
    average needs a sample, and Lab 1's PIL path measures in one thread.
    ``race_images`` and ``race_latency_ms`` size the race of the PIL DataLoader and the
    Daft pipeline from the store (:mod:`labkit.store_race`); its first-byte latency,
    as in ``benchmarks/object_store.py``, is another emulated condition.
    """

    num_images: int
    image_px: int
    batch_size: int
    rows_per_group: int
    latency_ms: float
    latency_images: int
    runner_images: int
    stage_images: int
    race_images: int = 512
    race_latency_ms: float = 10.0


SIZES = {
    "ci": EngineSizes(
        num_images=1_600, image_px=32, batch_size=64,
        rows_per_group=128, latency_ms=4.0, latency_images=256, runner_images=512,
        stage_images=1_600,
    ),
    "gpu": EngineSizes(
        num_images=8_000, image_px=64, batch_size=256,
        rows_per_group=256, latency_ms=4.0, latency_images=1_024, runner_images=4_096,
        stage_images=2_048, race_images=4_096,
    ),
    "multi-gpu": EngineSizes(
        num_images=20_000, image_px=64, batch_size=256,
        rows_per_group=256, latency_ms=4.0, latency_images=1_024, runner_images=8_192,
        stage_images=2_048, race_images=4_096,
    ),
}


BENCHMARK_IMAGES = 10_000


RESIZERS = ("torch", "daft")


def use_native_runner(num_threads: int | None = None) -> None:
    """Run Daft in this process with its local native runner.

    Daft fixes a process's runner on first use and refuses a second call, so a
    notebook run twice in one kernel would fail in its first cell. A process
    already on the native runner keeps it (with the thread count it was given
    first); a process on another runner is still an error.
    """
    try:
        daft.set_runner_native(num_threads=num_threads)
    except Exception as err:  # noqa: BLE001 - Daft raises its own core exception type
        if "more than once" not in str(err) or daft.get_or_infer_runner_type() != "native":
            raise


def check_positive(**values: float) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


@functools.lru_cache(maxsize=None)
def torch_resize(image_px: int) -> daft.Expression:
    """A Daft batch function: HWC uint8 tensors of any size -> ``image_px`` square, in torch.

    Antialiased bilinear, as PIL's ``BILINEAR`` downscale is. It runs in Daft's
    threads (``use_process=False``): torch releases the GIL inside the kernel.
    """
    check_positive(image_px=image_px)
    shape = (image_px, image_px, 3)

    @daft.func.batch(return_dtype=DataType.tensor(DataType.uint8(), shape=shape), use_process=False)
    def resize_in_torch(images: daft.Series) -> np.ndarray:
        out = np.empty((len(images), *shape), dtype=np.uint8)
        with torch.inference_mode():
            for row, pixels in enumerate(images.to_pylist()):
                # Daft hands out read-only arrays; torch wants writable memory.
                chw = torch.from_numpy(np.require(pixels, requirements="W")).permute(2, 0, 1)[None]
                small = F.interpolate(chw, size=shape[:2], mode="bilinear", antialias=True)
                out[row] = small[0].permute(1, 2, 0).numpy()
        return out

    return resize_in_torch


def resized(image: daft.Expression, image_px: int, resizer: str = "torch") -> daft.Expression:
    """A decoded image column resized to ``image_px`` square, as a uint8 HWC tensor column."""
    if resizer not in RESIZERS:
        raise ValueError(f"resizer must be one of {RESIZERS}, got {resizer!r}")
    check_positive(image_px=image_px)
    if resizer == "daft":
        return image_to_tensor(resize(image, image_px, image_px))
    return torch_resize(image_px)(image_to_tensor(image))


def decode_pipeline(
    frame: daft.DataFrame, image_px: int, *, bytes_column: str | None = None, resizer: str = "torch",
) -> daft.DataFrame:
    """``image`` (uint8 HWC tensor) and ``label`` columns: Daft downloads and decodes, then resizes.

    Without ``bytes_column`` the bytes are downloaded from ``path`` (local paths and
    ``s3://``/``gs://`` URLs alike); with it they come from a packed Parquet column.
    """
    source = col("path").download() if bytes_column is None else col(bytes_column)
    image = resized(source.decode_image(mode="RGB"), image_px, resizer)
    return frame.select(image.alias("image"), col("label"))


PIPELINE_CUTS = ("download", "decode", "resize: daft", "resize: torch")


def _cut_after(stage: str, image_px: int) -> daft.Expression:
    if stage not in PIPELINE_CUTS:
        raise ValueError(f"stage must be one of {PIPELINE_CUTS}, got {stage!r}")
    data = col("path").download()
    if stage == "download":
        return data
    image = data.decode_image(mode="RGB")
    if stage == "decode":
        return image
    return resized(image, image_px, stage.removeprefix("resize: "))


def stage_costs(frame: daft.DataFrame, image_px: int, *, repeats: int = 2) -> dict[str, float]:
    """CPU milliseconds per image of the pipeline cut after each stage (best of ``repeats``).

    A stage's cost is the difference between two cuts: that is how the slow stage is
    found, instead of guessed. The CPU of every Daft thread counts.
    """
    check_positive(image_px=image_px)
    images = frame.count_rows()
    if images == 0:
        raise ValueError("frame must select at least one image, got an empty selection")
    runs = {stage: functools.partial(_drain_cut, frame, stage, image_px) for stage in PIPELINE_CUTS}
    return cpu_ms_per_item(runs, images, repeats=repeats)


def _drain_cut(frame: daft.DataFrame, stage: str, image_px: int) -> None:
    _drain(frame, _cut_after(stage, image_px))


def _drain(frame: daft.DataFrame, expression: daft.Expression) -> None:
    for _ in frame.select(expression.alias("out")).to_arrow_iter():
        pass


def resize_costs(frame: daft.DataFrame, image_px: int, *, repeats: int = 3) -> dict[str, float]:
    """CPU milliseconds per image of each resizer, on images already decoded in memory.

    Why not the cut after the resize minus the cut after the decode: a resize costs a
    fraction of the decode, so that difference is mostly the decode's run-to-run
    noise. In six runs on the 2-core box it put torch's resize at 0.047-0.074 ms and
    in CI once at -0.007 ms, while decoding once and charging each resizer the CPU
    above passing the decoded images through gave 0.083-0.089 ms (Daft's
    0.221-0.225) in six runs on a quiet box, and 0.08-0.13 ms in ten runs of Lab 2 on a
    busier one. Best of ``repeats``, the runs taking turns.
    """
    check_positive(image_px=image_px)
    decoded = frame.select(_cut_after("decode", image_px).alias("image")).collect()
    images = decoded.count_rows()
    if images == 0:
        raise ValueError("frame must select at least one image, got an empty selection")
    runs = {"pass-through": functools.partial(_drain, decoded, col("image"))}
    runs |= {name: functools.partial(_drain, decoded, resized(col("image"), image_px, name)) for name in RESIZERS}
    cpu_ms = cpu_ms_per_item(runs, images, repeats=repeats)
    return {name: cpu_ms[name] - cpu_ms["pass-through"] for name in RESIZERS}


STAGES = ("bytes", "decode", "resize")


def stage_table(
    engine_cuts: dict[str, float], engine_resize: dict[str, float], pil_cuts: dict[str, float], *,
    resizer: str = "torch",
) -> dict[str, tuple[float, float]]:
    """Per stage, (PIL worker, Daft pipeline) CPU ms per image.

    A stage costs its cut minus the cut before it; getting the bytes is Daft's
    ``download`` and the worker's file ``read``. Daft's resize is ``engine_resize``
    (:func:`resize_costs`), measured alone: as a difference of Daft's cuts it is lost in
    the decode's noise. The PIL worker runs in one thread, where its cuts resolve the
    resize. The stage with the largest ratio is where the engine gains; the ones near
    1x bound what the whole path can gain.
    """
    if resizer not in RESIZERS:
        raise ValueError(f"resizer must be one of {RESIZERS}, got {resizer!r}")
    download, decode = engine_cuts["download"], engine_cuts["decode"]
    engine = (download, decode - download, engine_resize[resizer])
    pil = _steps((pil_cuts["read"], pil_cuts["decode"], pil_cuts["resize"]))
    return dict(zip(STAGES, zip(pil, engine)))


def _steps(cuts: Sequence[float]) -> list[float]:
    return [cut - before for before, cut in zip((0.0, *cuts), cuts)]


def torch_batches(
    frame: daft.DataFrame, batch_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield (uint8 images [B, 3, H, W], int64 labels [B]) from a frame with ``image`` and ``label``.

    ``to_arrow_iter`` hands over Arrow batches without a per-row Python object, so
    the only copy on the torch side is the HWC -> CHW layout change.
    """
    check_positive(batch_size=batch_size)
    for record_batch in frame.into_batches(batch_size).to_arrow_iter():
        if record_batch.num_rows == 0:
            continue
        images = record_batch.column("image").to_numpy_ndarray()
        labels = record_batch.column("label").to_numpy()
        yield (
            torch.from_numpy(np.ascontiguousarray(images.transpose(0, 3, 1, 2))),
            torch.from_numpy(labels.astype(np.int64)),
        )


def augment_batch(
    images: torch.Tensor, generator: torch.Generator, *, shift_px: int = 2
) -> torch.Tensor:
    """Random horizontal flip and shift (edge pixels repeated) per sample, batched.

    Daft's pipeline is deterministic per row; the randomness lives here, in a few
    batched torch ops that run on the accelerator when ``images`` is on one. Works
    on any dtype (uint8 stays uint8); ``generator`` must live on ``images.device``.
    """
    if images.dim() != 4:
        raise ValueError(f"images must be a [B, C, H, W] tensor, got shape {tuple(images.shape)}")
    if shift_px < 0:
        raise ValueError(f"shift_px must be >= 0, got {shift_px}")
    batch, _, height, width = images.shape
    device = images.device
    flip = torch.rand(batch, generator=generator, device=device) < 0.5
    dy = torch.randint(-shift_px, shift_px + 1, (batch,), generator=generator, device=device)
    dx = torch.randint(-shift_px, shift_px + 1, (batch,), generator=generator, device=device)
    columns = torch.arange(width, device=device).expand(batch, width)
    columns = torch.where(flip[:, None], columns.flip(1), columns)
    rows = (torch.arange(height, device=device) + dy[:, None]).clamp_(0, height - 1)
    columns = (columns + dx[:, None]).clamp_(0, width - 1)
    pixels = images.permute(0, 2, 3, 1)
    index = torch.arange(batch, device=device)[:, None, None]
    return pixels[index, rows[:, :, None], columns[:, None, :]].permute(0, 3, 1, 2).contiguous()


def make_accelerator(sizes: EngineSizes, device: torch.device | str, *, decode_ms_per_image: float,
                     loader_cores: int) -> Accelerator:
    """What the loader feeds, sized as Lab 1 sizes its accelerator (:func:`~labkit.ladder.rate_over_loader`):
    :data:`~labkit.ladder.ACCELERATOR_OVER_LOADER` times what ``loader_cores`` decode at
    ``decode_ms_per_image`` (a PIL worker's whole path, measured).

    On a GPU a real model step, as wide as it measures it must be to run that fast;
    on a CPU the stand-in emulation: Lab 2 compares loaders with each other, each given
    every host core, and Lab 1's pinned-core model would take one of the two cores here.
    At a fixed 5000 images/s the stand-in ran about as fast as two cores decode, so
    every feed kept it 0.74-0.95 busy and the tensor cache led the file path by only
    1.14-1.20x in two runs: inside the spread of a feed measured twice. Sized so, it
    ran at 9900-12200 images/s in ten runs of Lab 2 on a 2-core box, and the cache led
    Daft from the files by 1.86-2.56x.
    """
    return accelerator_for(device, images_per_s=rate_over_loader(decode_ms_per_image, loader_cores),
                           batch_size=sizes.batch_size, image_px=sizes.image_px, emulate=True)


CACHE_LEAD = 1.5
"""The least the tensor cache must lead Daft from the files by, in images/s.

The stand-in runs at :data:`~labkit.ladder.ACCELERATOR_OVER_LOADER` (3) times what the loader's cores
decode, so a feed with nothing left to decode can approach 3x a decode-bound one; half of that is asked.
In twenty runs of Lab 2 on a 2-core box the tensor cache led the files by 1.86-2.56x. The packed JPEG
bytes, which still decode, led them by 1.08-1.56x, so the bound does not tell a cache from a faster
read; it tells one from a feed that decodes again, which the same Daft pipeline measured twice can put
25% either side of 1x.
"""


def measure_feed(
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    accelerator: Accelerator,
    *,
    device: torch.device | str = "cpu",
    augment: bool = True,
    seed: int = 0,
) -> MeterSummary:
    """Feed ``batches`` to ``accelerator`` under Lab 1's step meter: images/s and busy fraction.

    The batch moves to ``device`` and is augmented there, inside the compute span:
    on a GPU that work is the accelerator's, not the loader's.
    """
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    meter = StepMeter(device)
    with host_threads(1 if device.type == "cpu" else None):
        for images, labels in meter.iterate(batches):
            with meter.computing(len(images), accelerator.stolen_ms):
                images = images.to(device, non_blocking=True)
                labels = labels.to(device, non_blocking=True)
                if augment:
                    images = augment_batch(images, generator)
                accelerator.step(images, labels)
    return meter.summary()


def drain(batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> tuple[int, float]:
    """(images, seconds) to pull every batch out of a loader, start-up included."""
    start = time.perf_counter()
    images = sum(len(batch[0]) for batch in batches)
    return images, time.perf_counter() - start
