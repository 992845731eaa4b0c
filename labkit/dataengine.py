"""The data engine: one Daft pipeline from a catalog selection to a training batch.

Lab 1 found that the accelerator waits on the input path. This module moves the
diagnosis upstream, to how the dataset is *represented*:

* **files** -- the catalog's paths; every image is one object to fetch, then decoded
  and resized at every step (decode-per-step);
* **packed** -- the JPEG bytes inside a Parquet file, grouped in row groups: the same
  bytes, but one request fetches a whole row group, so remote storage pays its
  per-object latency N / rows-per-group times instead of N;
* **tensor cache** -- decoded, resized uint8 tensors in Parquet, written by the engine:
  Lab 1's transformed cache, paid for once instead of every epoch.

Daft does the I/O and decoding in native threads. The resize is torch's antialiased
bilinear kernel inside a Daft batch function: in six runs on the 2-core CI box, per
image of this course's JPEGs, Daft's own ``resize`` (the ``image`` crate's triangle
filter) cost 0.27-0.39 ms of CPU and torch's uint8 kernel 0.07-0.25 ms, beside a
0.5-0.65 ms decode (:func:`stage_costs` measures it on your machine).
``resizer="daft"`` keeps Daft's resize for comparison. The decode is not where the
engine gains: in three of those runs Lab 1's PIL worker decoded the same images in
0.39-0.47 ms (:func:`stage_table` sets the two paths side by side). Daft has no
per-sample random augmentation, so :func:`augment_batch` does it on the whole batch
in torch, on the accelerator where there is one.

The runner (native threads or a Ray cluster) can be set once per process, so
:func:`compare_runners` runs the same pipeline in one subprocess per runner
(``python -m labkit.dataengine --runner ray``).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Protocol, Sequence

os.environ.setdefault("DAFT_ANALYTICS_ENABLED", "0")

import daft  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from daft import DataType, col  # noqa: E402
from daft.functions import image_to_tensor, resize  # noqa: E402

from labkit.atomic import atomic_file  # noqa: E402
from labkit.catalog import CatalogError, catalog_path, read_catalog  # noqa: E402
from labkit.devices import cpu_ms_per_item, host_threads  # noqa: E402
from labkit.accelerator import accelerator_for  # noqa: E402
from labkit.meter import MeterSummary, StepMeter  # noqa: E402
from labkit import processes  # noqa: E402
from labkit.objectstore import HttpFetch, ObjectStore, open_ranged  # noqa: E402


@dataclass(frozen=True)
class EngineSizes:
    """One profile's experiment sizes.

    ``stand_in_images_per_s`` is the rate the accelerator consumes images at, chosen
    as in Lab 1 (:func:`labkit.accelerator.accelerator_for`): on a CPU, the stand-in
    emulation (it waits without using the host CPU); on a GPU, a real model step
    widened until its measured rate is about this.
    ``latency_ms`` is the object store's first-byte latency per request: an emulated condition
    (:mod:`labkit.objectstore`), since this box has no remote bucket.
    ``stage_images`` caps the images whose stage costs are measured: a per-image
    average needs a sample, and Lab 1's PIL path measures in one thread.
    """

    num_images: int
    image_px: int
    batch_size: int
    stand_in_images_per_s: float
    rows_per_group: int
    latency_ms: float
    latency_images: int
    runner_images: int
    stage_images: int


class Accelerator(Protocol):
    def step(self, images: torch.Tensor, labels: torch.Tensor) -> None: ...


SIZES = {
    "ci": EngineSizes(
        num_images=1_600, image_px=32, batch_size=64, stand_in_images_per_s=5_000.0,
        rows_per_group=128, latency_ms=4.0, latency_images=256, runner_images=512,
        stage_images=1_600,
    ),
    "gpu": EngineSizes(
        num_images=8_000, image_px=64, batch_size=256, stand_in_images_per_s=8_000.0,
        rows_per_group=256, latency_ms=4.0, latency_images=1_024, runner_images=4_096,
        stage_images=2_048,
    ),
    "multi-gpu": EngineSizes(
        num_images=20_000, image_px=64, batch_size=256, stand_in_images_per_s=8_000.0,
        rows_per_group=256, latency_ms=4.0, latency_images=1_024, runner_images=8_192,
        stage_images=2_048,
    ),
}
BENCHMARK_IMAGES = 10_000
RUNNERS = ("native", "ray")
RESIZERS = ("torch", "daft")
SKIP_RAY_ENV = "LABKIT_SKIP_RAY"
RAY_START_TIMEOUT = "The current node timed out during startup"


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


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


@functools.lru_cache(maxsize=None)
def torch_resize(image_px: int) -> daft.Expression:
    """A Daft batch function: HWC uint8 tensors of any size -> ``image_px`` square, in torch.

    Antialiased bilinear, as PIL's ``BILINEAR`` downscale is. It runs in Daft's
    threads (``use_process=False``): torch releases the GIL inside the kernel.
    """
    _check_positive(image_px=image_px)
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
    _check_positive(image_px=image_px)
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
    _check_positive(image_px=image_px)
    images = frame.count_rows()
    if images == 0:
        raise ValueError("frame must select at least one image, got an empty selection")
    runs = {stage: functools.partial(_drain_cut, frame, stage, image_px) for stage in PIPELINE_CUTS}
    return cpu_ms_per_item(runs, images, repeats=repeats)


def _drain_cut(frame: daft.DataFrame, stage: str, image_px: int) -> None:
    for _ in frame.select(_cut_after(stage, image_px).alias("out")).to_arrow_iter():
        pass


STAGES = ("bytes", "decode", "resize")


def stage_table(
    engine_cuts: dict[str, float], pil_cuts: dict[str, float], *, resizer: str = "torch",
) -> dict[str, tuple[float, float]]:
    """Per stage, (PIL worker, Daft pipeline) CPU ms per image, from each path's cuts.

    A stage costs its cut minus the cut before it; getting the bytes is Daft's
    ``download`` and the worker's file ``read``. The stage with the largest ratio
    is where the engine gains; the ones near 1x bound what the whole path can gain.
    """
    if resizer not in RESIZERS:
        raise ValueError(f"resizer must be one of {RESIZERS}, got {resizer!r}")
    engine = _steps((engine_cuts["download"], engine_cuts["decode"], engine_cuts[f"resize: {resizer}"]))
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
    _check_positive(batch_size=batch_size)
    for record_batch in frame.into_batches(batch_size).to_arrow_iter():
        if record_batch.num_rows == 0:
            continue
        images = record_batch.column("image").to_numpy_ndarray()
        labels = record_batch.column("label").to_numpy()
        yield (
            torch.from_numpy(np.ascontiguousarray(images.transpose(0, 3, 1, 2))),
            torch.from_numpy(labels.astype(np.int64)),
        )


@dataclass(frozen=True)
class Representation:
    """One way of storing the selected images, and what it costs on disk."""

    name: str
    objects: int
    disk_bytes: int
    rows: int
    row_groups: int
    write_s: float
    path: Path | None = None

    @property
    def bytes_per_image(self) -> float:
        return self.disk_bytes / self.rows if self.rows else 0.0

    def as_row(self) -> dict[str, object]:
        return {
            "representation": self.name,
            "objects": self.objects,
            "row_groups": self.row_groups,
            "disk_MB": round(self.disk_bytes / 1e6, 2),
            "bytes_per_image": round(self.bytes_per_image),
            "write_s": round(self.write_s, 2),
        }


def files_representation(frame: daft.DataFrame) -> Representation:
    """The catalog's own representation: one object per image, sizes from the ``bytes`` column."""
    table = frame.select("bytes").to_pydict()["bytes"]
    return Representation(
        name="files", objects=len(table), disk_bytes=int(sum(table)), rows=len(table),
        row_groups=0, write_s=0.0,
    )


def _representation(name: str, target: Path, write_s: float) -> Representation:
    metadata = pq.ParquetFile(target).metadata
    return Representation(
        name=name, objects=1, disk_bytes=target.stat().st_size, rows=metadata.num_rows,
        row_groups=metadata.num_row_groups, write_s=write_s, path=target,
    )


def write_packed(
    frame: daft.DataFrame, target: str | Path, *, rows_per_group: int = 128
) -> Representation:
    """Pack the selected images' JPEG bytes into one Parquet file (the remote-storage format).

    Daft downloads the bytes and cuts exact batches of ``rows_per_group``; pyarrow's
    writer makes each batch one row group, the unit a reader fetches in one request.
    """
    _check_positive(rows_per_group=rows_per_group)
    target = Path(target)
    packed = frame.select(col("image_id"), col("label"), col("path").download().alias("jpeg"))
    start = time.perf_counter()
    batches = packed.into_batches(rows_per_group).to_arrow_iter()
    first = next(batches, None)
    if first is None:
        raise ValueError("frame must select at least one image, got an empty selection")
    with atomic_file(target) as tmp:
        with pq.ParquetWriter(tmp, first.schema) as writer:
            for batch in itertools.chain([first], batches):
                writer.write_batch(batch, row_group_size=rows_per_group)
    return _representation("packed", target, time.perf_counter() - start)


def write_tensor_cache(frame: daft.DataFrame, target: str | Path, image_px: int) -> Representation:
    """Decode and resize once; Daft writes the uint8 tensors to Parquet (the training cache)."""
    target = Path(target)
    start = time.perf_counter()
    with atomic_file(target) as tmp:
        decode_pipeline(frame, image_px).write_parquet(str(tmp), write_mode="overwrite", single_file=True)
    return _representation("tensor cache", target, time.perf_counter() - start)


def file_batches(
    frame: daft.DataFrame, image_px: int, batch_size: int, *, resizer: str = "torch"
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Decode-per-step from the files the catalog points at."""
    return torch_batches(decode_pipeline(frame, image_px, resizer=resizer), batch_size)


def packed_batches(
    path: str | Path, image_px: int, batch_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Decode-per-step from JPEG bytes packed in Parquet."""
    frame = daft.read_parquet(str(path))
    return torch_batches(decode_pipeline(frame, image_px, bytes_column="jpeg"), batch_size)


def cache_batches(path: str | Path, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Ready tensors from the cache: no decode, no resize."""
    return torch_batches(daft.read_parquet(str(path)).select("image", "label"), batch_size)


@dataclass(frozen=True)
class FetchResult:
    """What fetching a representation's bytes cost from the object store, as its server logged it."""

    name: str
    images: int
    data_requests: int
    metadata_requests: int
    bytes_read: int
    fetch_s: float

    def as_row(self) -> dict[str, object]:
        return {
            "representation": self.name,
            "images": self.images,
            "data_requests": self.data_requests,
            "metadata_requests": self.metadata_requests,
            "MB_read": round(self.bytes_read / 1e6, 2),
            "fetch_s": round(self.fetch_s, 3),
        }


def fetch_files(store: ObjectStore, paths: Sequence[str]) -> FetchResult:
    """GET every image file from ``store``, one after another: one request per object."""
    fetch = HttpFetch([store.url(path) for path in paths])
    before = len(store.log())
    start = time.perf_counter()
    for index in range(len(paths)):
        fetch(index)
    fetch_s = time.perf_counter() - start
    served = store.log()[before:]
    return FetchResult(name="files", images=len(paths), data_requests=len(served), metadata_requests=0,
                       bytes_read=sum(record["bytes"] for record in served), fetch_s=fetch_s)


def fetch_parquet(
    store: ObjectStore, path: str | Path, *, name: str, max_images: int | None = None,
) -> FetchResult:
    """Read a Parquet file from ``store`` row group by row group, as a reader on object storage does.

    pyarrow's ``pre_buffer`` coalesces one row group's column chunks into one ranged
    request; finding the footer (a HEAD for the size, then the footer itself) costs
    requests of its own. With ``max_images`` it stops after the row group that
    reaches that many images. Requests and bytes come from the server's log.
    """
    before = len(store.log())
    start = time.perf_counter()
    with open_ranged(store.url(path)) as handle:
        parquet = pq.ParquetFile(handle, pre_buffer=True)
        metadata_requests = len(store.log()) - before
        images = 0
        for index in range(parquet.num_row_groups):
            if max_images is not None and images >= max_images:
                break
            images += parquet.read_row_group(index).num_rows
    fetch_s = time.perf_counter() - start
    served = store.log()[before:]
    return FetchResult(name=name, images=images, data_requests=len(served) - metadata_requests,
                       metadata_requests=metadata_requests, bytes_read=sum(record["bytes"] for record in served),
                       fetch_s=fetch_s)


@dataclass(frozen=True)
class PushdownReads:
    """Bytes the object store served for three Daft reads of one packed Parquet file."""

    whole_bytes: int
    """Every column of every row."""
    projected_bytes: int
    """``select("label")``: projection pushdown fetches that column's chunks only."""
    filtered_bytes: int
    """``where(image_id <= the first row group's max)``: filter pushdown skips row groups by their statistics."""
    row_groups: int

    def as_row(self) -> dict[str, object]:
        return {"whole_MB": round(self.whole_bytes / 1e6, 3), "label_column_MB": round(self.projected_bytes / 1e6, 3),
                "first_row_group_MB": round(self.filtered_bytes / 1e6, 3), "row_groups": self.row_groups}


def read_parquet_url(url: str) -> daft.DataFrame:
    """Daft's lazy Parquet scan of ``url``: what it later reads depends on the plan pushed into it."""
    return daft.read_parquet(url)


def pushdown_reads(store: ObjectStore, path: str | Path) -> PushdownReads:
    """Read a packed file from ``store`` whole, one column, and one row group's rows; bytes from the server's log.

    Daft pushes a ``select`` and a ``where`` into its Parquet scan: a column that is
    not asked for is not fetched, and a row group whose min/max statistics exclude
    the filter is skipped. The server's log shows whether that happened.
    """
    metadata = pq.ParquetFile(path).metadata
    image_id = metadata.schema.names.index("image_id")
    first_max = metadata.row_group(0).column(image_id).statistics.max
    url = store.url(path)

    def served(query: Callable[[daft.DataFrame], daft.DataFrame]) -> int:
        """Bytes served from planning the scan (Daft reads the footer then) to the last row."""
        before = len(store.log())
        query(read_parquet_url(url)).collect()
        return sum(record["bytes"] for record in store.log()[before:])

    return PushdownReads(
        whole_bytes=served(lambda frame: frame),
        projected_bytes=served(lambda frame: frame.select("label")),
        filtered_bytes=served(lambda frame: frame.where(col("image_id") <= first_max)),
        row_groups=metadata.num_row_groups,
    )


def expected_requests(num_images: int, rows_per_group: int) -> int:
    """Data requests for ``num_images`` packed ``rows_per_group`` to a row group (vs N for files)."""
    if num_images < 0 or rows_per_group < 1:
        raise ValueError(
            f"num_images must be >= 0 and rows_per_group >= 1, got {num_images}, {rows_per_group}"
        )
    return math.ceil(num_images / rows_per_group)


def rows_per_group(path: str | Path) -> int:
    """The largest row group of a Parquet file (for :func:`write_packed`, all but the last)."""
    metadata = pq.ParquetFile(path).metadata
    return max(metadata.row_group(index).num_rows for index in range(metadata.num_row_groups))


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


def make_accelerator(sizes: EngineSizes, device: torch.device | str) -> Accelerator:
    """What the loader feeds: on a GPU a real model step, as wide as it measures it must
    be to run at about ``sizes.stand_in_images_per_s`` at this lab's image size; on a
    CPU the stand-in emulation. Lab 2 compares loaders with each other, each given
    every host core; Lab 1's pinned-core model would take one of the two cores here."""
    return accelerator_for(device, images_per_s=sizes.stand_in_images_per_s, batch_size=sizes.batch_size,
                           image_px=sizes.image_px, emulate=True)


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
            with meter.computing(len(images)):
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


@dataclass(frozen=True)
class RunnerResult:
    """One runner's pass over the same pipeline, from its own subprocess."""

    runner: str
    images: int = 0
    label_sum: int = 0
    pixel_sum: int = 0
    pipeline_s: float = 0.0
    process_s: float = 0.0
    skipped: str | None = None

    @property
    def images_per_s(self) -> float:
        return self.images / self.pipeline_s if self.pipeline_s else 0.0


def ray_unavailable_reason() -> str | None:
    """Why the Ray runner cannot run here, or None when it can."""
    if os.environ.get(SKIP_RAY_ENV):
        return f"{SKIP_RAY_ENV} is set (ray.init costs tens of seconds on a small machine)"
    if importlib.util.find_spec("ray") is None:
        return "Ray is not installed; pip install 'labkit[distributed]' (ray[data]>=2.40,<2.60)"
    return None


def run_pipeline(
    catalog: str | Path, *, runner: str, image_px: int, limit: int,
    ray_address: str | None = None, num_threads: int | None = None,
) -> RunnerResult:
    """Set the runner for this process, run the decode pipeline over ``limit`` rows, checksum it.

    Call once per process: Daft fixes the runner on first use.
    """
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}")
    _check_positive(image_px=image_px, limit=limit)
    catalog_path(catalog)
    if runner == "ray":
        if ray_address is None:
            import ray

            # A local Ray without its dashboard starts faster; Daft reuses an initialised Ray.
            ray.init(include_dashboard=False, log_to_driver=False, num_cpus=num_threads)
        daft.set_runner_ray(address=ray_address)
    else:
        use_native_runner(num_threads)
    start = time.perf_counter()
    frame = decode_pipeline(read_catalog(catalog).sort("image_id").limit(limit), image_px)
    images = label_sum = pixel_sum = 0
    for record_batch in frame.to_arrow_iter():
        pixels = record_batch.column("image").to_numpy_ndarray()
        images += record_batch.num_rows
        label_sum += int(record_batch.column("label").to_numpy().sum())
        pixel_sum += int(pixels.sum(dtype="int64"))
    return RunnerResult(
        runner=runner, images=images, label_sum=label_sum, pixel_sum=pixel_sum,
        pipeline_s=time.perf_counter() - start,
    )


def _run_runner(command: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """Run one runner's subprocess in its own session; past ``timeout_s`` stop its whole group and raise."""
    env = {**os.environ, "DAFT_ANALYTICS_ENABLED": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          start_new_session=True) as child:
        try:
            stdout, stderr = child.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            processes.kill_group(child.pid)
            child.communicate()
            raise RuntimeError(f"{' '.join(command[2:])} did not finish within {timeout_s:.0f} s; stopped it and "
                               f"every process it started") from None
        except BaseException:   # an interrupted cell: stop the runner and its Ray node too
            processes.kill_group(child.pid)
            child.communicate()
            raise
    return subprocess.CompletedProcess(command, child.returncode, stdout, stderr)


def compare_runners(
    catalog: str | Path, *, image_px: int, limit: int, runners: Sequence[str] = RUNNERS,
    ray_address: str | None = None, timeout_s: float = 300.0,
) -> list[RunnerResult]:
    """Run the same pipeline once per runner, each in a fresh ``python -m labkit.dataengine``.

    Ray is skipped, with the reason, only when it is not installed or ``LABKIT_SKIP_RAY``
    is set. A Ray that is installed and does not start or finish in time is a
    failure, raised with its error output: a skip would hide exactly the problem a
    learner needs to see. Each runner runs in its own session, and a runner that
    overruns is stopped with every process it started (Ray's node among them).
    """
    results = []
    for runner in runners:
        if runner not in RUNNERS:
            raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}")
        reason = ray_unavailable_reason() if runner == "ray" else None
        if reason:
            results.append(RunnerResult(runner=runner, skipped=reason))
            continue
        command = [
            sys.executable, "-m", "labkit.dataengine", "--catalog", str(catalog),
            "--runner", runner, "--image-px", str(image_px), "--limit", str(limit),
        ]
        if ray_address:
            command += ["--ray-address", ray_address]
        start = time.perf_counter()
        done = _run_runner(command, timeout_s)
        if done.returncode != 0:
            hint = (f" A local Ray node did not start in time; on a busy machine retry, or set {SKIP_RAY_ENV}=1 "
                    "to leave Ray out on purpose." if RAY_START_TIMEOUT in done.stderr else "")
            raise RuntimeError(f"runner {runner!r} failed (exit {done.returncode}).{hint}\n{done.stderr[-3000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        results.append(RunnerResult(**{**result, "process_s": time.perf_counter() - start}))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m labkit.dataengine",
        description="Run the decode pipeline on one Daft runner and print a JSON result line.",
    )
    parser.add_argument("--catalog", required=True, help="path to catalog.parquet")
    parser.add_argument("--runner", choices=RUNNERS, default="native")
    parser.add_argument("--image-px", type=int, default=32)
    parser.add_argument("--limit", type=int, default=512)
    parser.add_argument("--num-threads", type=int, default=None, help="native runner threads")
    parser.add_argument(
        "--ray-address", default=os.environ.get("RAY_ADDRESS"),
        help="an existing Ray cluster (ray://host:10001); default starts a local one",
    )
    args = parser.parse_args(argv)
    try:
        result = run_pipeline(
            args.catalog, runner=args.runner, image_px=args.image_px, limit=args.limit,
            ray_address=args.ray_address, num_threads=args.num_threads,
        )
    except (CatalogError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
