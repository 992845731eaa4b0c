"""Lab 2's data engine: one pipeline, three representations, the same pixels, honest request counts."""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import daft
import pytest
import torch

from labkit import catalog, daft_runners, dataengine, representations
from labkit.objectstore import ObjectStore

IMAGE_PX = 16
ROWS_PER_GROUP = 10


@pytest.fixture(scope="module")
def selected(small_dataset):
    return catalog.select(catalog.read_catalog(small_dataset), catalog.Selection(split=None))


@pytest.fixture(scope="module")
def stores(selected, tmp_path_factory):
    folder = tmp_path_factory.mktemp("representations")
    packed = representations.write_packed(selected, folder / "packed.parquet", rows_per_group=ROWS_PER_GROUP)
    cache = representations.write_tensor_cache(selected, folder / "tensors.parquet", IMAGE_PX)
    return representations.files_representation(selected), packed, cache


def _collect(batches):
    images, labels = zip(*batches)
    return torch.cat(images), torch.cat(labels)


def test_pipeline_yields_uint8_chw_batches_of_the_batch_size(selected):
    batches = list(representations.file_batches(selected, IMAGE_PX, batch_size=32))
    assert all(images.shape[1:] == (3, IMAGE_PX, IMAGE_PX) for images, _ in batches)
    assert all(images.dtype == torch.uint8 and labels.dtype == torch.int64 for images, labels in batches)
    assert [len(labels) for _, labels in batches[:-1]] == [32] * (len(batches) - 1)
    assert sum(len(labels) for _, labels in batches) == selected.count_rows()


def test_every_representation_feeds_the_same_pixels(selected, stores):
    _, packed, cache = stores
    by_label = []
    for batches in (
        representations.file_batches(selected, IMAGE_PX, 32),
        representations.packed_batches(packed.path, IMAGE_PX, 32),
        representations.cache_batches(cache.path, 32),
    ):
        images, labels = _collect(batches)
        by_label.append((labels.sort().values.tolist(), int(images.sum(dtype=torch.int64))))
    assert by_label[0] == by_label[1] == by_label[2]


def test_packed_holds_the_same_bytes_in_one_object(stores):
    files, packed, _ = stores
    assert files.objects == files.rows and packed.objects == 1
    assert packed.rows == files.rows
    assert abs(packed.disk_bytes - files.disk_bytes) < 0.05 * files.disk_bytes


def test_tensor_cache_stores_at_most_the_raw_training_pixels(stores):
    _, _, cache = stores
    raw_bytes = cache.rows * 3 * IMAGE_PX * IMAGE_PX
    assert cache.disk_bytes < 1.1 * raw_bytes + (64 << 10)


def test_packed_needs_one_request_per_row_group_not_per_image(selected, stores):
    files, packed, _ = stores
    assert packed.row_groups > 1
    paths = selected.select("path").to_pydict()["path"]
    with ObjectStore(os.path.commonpath([*paths, str(packed.path)])) as store:
        fetched_files = representations.fetch_files(store, paths)
        assert fetched_files.data_requests == len(paths) == store.requests("GET")
        fetched = representations.fetch_parquet(store, packed.path, name="packed")
        assert fetched.data_requests + fetched.metadata_requests == store.requests() - len(paths)
    assert fetched_files.bytes_read == sum(os.path.getsize(path) for path in paths)
    assert fetched.images == len(paths)
    assert fetched.data_requests == packed.row_groups == math.ceil(len(paths) / ROWS_PER_GROUP)
    assert representations.rows_per_group(packed.path) == ROWS_PER_GROUP


def test_daft_pushes_projection_and_row_group_filters_into_the_scan_as_the_server_sees(stores):
    _, packed, _ = stores
    with ObjectStore(packed.path.parent) as store:
        reads = representations.pushdown_reads(store, packed.path)
    assert reads.row_groups == packed.row_groups > 1
    assert reads.whole_bytes >= packed.disk_bytes
    assert reads.projected_bytes < reads.whole_bytes / 2
    assert reads.filtered_bytes < reads.whole_bytes / 2


def test_the_stores_first_byte_latency_is_paid_once_per_request(selected):
    paths = selected.select("path").to_pydict()["path"][:5]
    with ObjectStore(os.path.commonpath(paths), first_byte_ms=20) as store:
        fetched = representations.fetch_files(store, paths)
        assert fetched.data_requests == store.requests() == 5
    assert fetched.fetch_s >= 5 * 0.020


def test_expected_requests_is_n_over_rows_per_group():
    assert representations.expected_requests(1000, 1) == 1000
    assert representations.expected_requests(1000, 128) == 8
    with pytest.raises(ValueError, match="rows_per_group >= 1"):
        representations.expected_requests(10, 0)


@pytest.mark.alone  # an ordering of two timings
def test_tensor_cache_beats_decode_per_step(selected, stores):
    _, _, cache = stores

    def best_s(make):
        return min(dataengine.drain(make())[1] for _ in range(3))

    decode_s = best_s(lambda: representations.file_batches(selected, IMAGE_PX, 32))
    cache_s = best_s(lambda: representations.cache_batches(cache.path, 32))
    assert cache_s < decode_s


def test_augmentation_is_seeded_and_flips_some_samples_not_all():
    images = torch.randint(0, 256, (256, 3, 8, 8), dtype=torch.uint8)
    first = dataengine.augment_batch(images, torch.Generator().manual_seed(0), shift_px=0)
    again = dataengine.augment_batch(images, torch.Generator().manual_seed(0), shift_px=0)
    assert torch.equal(first, again) and first.dtype == torch.uint8
    flipped = (first == images.flip(3)).flatten(1).all(1)
    unchanged = (first == images).flatten(1).all(1)
    assert bool((flipped | unchanged).all())
    assert 64 < int(flipped.sum()) < 192


def _every_flip_and_shift(image, shift_px):
    height, width = image.shape[1:]
    for flipped in (image, image.flip(2)):
        for dy in range(-shift_px, shift_px + 1):
            for dx in range(-shift_px, shift_px + 1):
                rows = (torch.arange(height) + dy).clamp(0, height - 1)
                cols = (torch.arange(width) + dx).clamp(0, width - 1)
                yield flipped[:, rows][:, :, cols]


def test_each_sample_is_its_image_flipped_or_not_and_shifted_by_at_most_shift_px():
    images = torch.randint(0, 256, (16, 3, 6, 6), dtype=torch.uint8)
    augmented = dataengine.augment_batch(images, torch.Generator().manual_seed(1), shift_px=2)
    assert augmented.shape == images.shape
    for image, out in zip(images, augmented):
        assert any(torch.equal(out, candidate) for candidate in _every_flip_and_shift(image, 2))
    with pytest.raises(ValueError, match="shift_px must be >= 0"):
        dataengine.augment_batch(images, torch.Generator(), shift_px=-1)


def test_step_meter_sees_every_image_but_the_first_batch(stores):
    _, _, cache = stores
    from labkit.accelerator import StandInAccelerator

    summary = dataengine.measure_feed(
        representations.cache_batches(cache.path, 16), StandInAccelerator(images_per_s=50_000)
    )
    assert summary.items == cache.rows - 16
    assert 0.0 < summary.busy_fraction <= 1.0


def test_ray_skips_with_a_reason_when_asked(monkeypatch, small_dataset):
    monkeypatch.setenv(daft_runners.SKIP_RAY_ENV, "1")
    (result,) = daft_runners.compare_runners(small_dataset.catalog_path, image_px=8, limit=8, runners=("ray",))
    assert result.skipped and daft_runners.SKIP_RAY_ENV in result.skipped


@pytest.mark.parametrize("exit_code", [0, 1])
def test_a_local_ray_keeps_its_session_in_a_folder_removed_when_it_ends(monkeypatch, small_dataset, exit_code):
    """By default Ray leaves each session in /tmp/ray for good; the lab's runs must leave nothing."""
    sessions = []

    def fake_runner(command, timeout_s):
        folder = command[command.index("--ray-temp-dir") + 1]
        (Path(folder) / "session_x" / "logs").mkdir(parents=True)   # what a local Ray writes there
        sessions.append(Path(folder))
        result = json.dumps({"runner": "ray", "images": 8})
        return subprocess.CompletedProcess(command, exit_code, result + "\n", "a Ray that failed")

    monkeypatch.setattr(daft_runners, "ray_unavailable_reason", lambda: None)
    monkeypatch.setattr(daft_runners, "_run_runner", fake_runner)
    if exit_code:
        with pytest.raises(RuntimeError, match="a Ray that failed"):
            daft_runners.compare_runners(small_dataset.catalog_path, image_px=8, limit=8, runners=("ray",))
    else:
        daft_runners.compare_runners(small_dataset.catalog_path, image_px=8, limit=8, runners=("ray",))
    assert len(sessions) == 1 and sessions[0].name.startswith("labkit-ray-") and not sessions[0].exists()


def test_bad_runner_is_refused_before_any_process_starts(small_dataset):
    with pytest.raises(ValueError, match="runner must be one of"):
        daft_runners.compare_runners(small_dataset.catalog_path, image_px=8, limit=8, runners=("spark",))


def test_cli_names_a_missing_catalog(tmp_path, capsys):
    assert daft_runners.main(["--catalog", str(tmp_path / "none.parquet")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_native_runner_in_a_subprocess_decodes_the_selected_images(small_dataset):
    start = time.perf_counter()
    (native,) = daft_runners.compare_runners(small_dataset.catalog_path, image_px=8, limit=24, runners=("native",))
    assert native.images == 24 and native.skipped is None
    assert native.process_s <= time.perf_counter() - start
    table = small_dataset.catalog().sort_by("image_id").slice(0, 24)
    assert native.label_sum == sum(table.column("label").to_pylist())


def test_a_runner_that_overruns_is_stopped_with_what_it_started_and_named(tmp_path):
    from labkit.processes import running

    pid_file = tmp_path / "grandchild.pid"
    script = ("import subprocess, time, pathlib; child = subprocess.Popen(['sleep', '60']); "
              f"pathlib.Path({str(pid_file)!r}).write_text(str(child.pid)); time.sleep(60)")
    with pytest.raises(RuntimeError, match="did not finish within 2 s; stopped it and every process it started"):
        daft_runners._run_runner([sys.executable, "-c", script], timeout_s=2)
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while running(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(grandchild), "a Ray node the runner started would be left behind"


def test_a_file_lost_after_the_check_is_named_by_the_pipeline(tmp_path):
    import daft

    lost = str(tmp_path / "lost.jpg")
    frame = daft.from_pydict({"path": [lost], "label": [0]})
    with pytest.raises(FileNotFoundError, match="lost.jpg"):
        list(representations.file_batches(frame, IMAGE_PX, 4))


def test_both_resizers_give_pil_bilinear_pixels(selected):
    """Torch's antialiased bilinear and Daft's triangle filter both downscale as PIL's BILINEAR does."""
    import numpy as np
    from PIL import Image

    paths = selected.select("path").limit(32).to_pydict()["path"]
    expected = torch.stack([
        torch.from_numpy(np.array(Image.open(path).convert("RGB").resize((IMAGE_PX, IMAGE_PX), Image.BILINEAR)))
        for path in paths
    ]).permute(0, 3, 1, 2).float()
    for resizer in dataengine.RESIZERS:
        images, _ = next(representations.file_batches(selected.limit(32), IMAGE_PX, 32, resizer=resizer))
        difference = (images.float() - expected).abs()
        assert difference.mean() < 1.0 and difference.max() <= 8, resizer


def test_resizer_and_stage_names_are_checked(selected):
    with pytest.raises(ValueError, match="resizer must be one of"):
        dataengine.decode_pipeline(selected, IMAGE_PX, resizer="bicubic")
    with pytest.raises(ValueError, match="image_px must be >= 1"):
        dataengine.torch_resize(0)
    with pytest.raises(ValueError, match="empty selection"):
        dataengine.stage_costs(selected.where(daft.col("label") < 0), IMAGE_PX)


def test_stage_costs_charge_every_cut_and_decode_costs_more_than_download(selected):
    costs = dataengine.stage_costs(selected, IMAGE_PX, repeats=1)
    assert tuple(costs) == dataengine.PIPELINE_CUTS
    assert all(ms > 0 for ms in costs.values())
    assert costs["decode"] > costs["download"]


def test_resize_costs_charge_each_resizer_alone_and_torch_costs_less(selected):
    """CPU time, not wall time, so it runs beside other tests: Daft's resize to 16 px cost 3.4-3.7x torch's in five runs."""
    costs = dataengine.resize_costs(selected, IMAGE_PX, repeats=2)
    assert tuple(costs) == dataengine.RESIZERS
    assert 0 < costs["torch"] < costs["daft"]
    with pytest.raises(ValueError, match="empty selection"):
        dataengine.resize_costs(selected.where(daft.col("label") < 0), IMAGE_PX)


def test_stage_table_charges_each_stage_its_cut_minus_the_one_before_and_the_resize_alone():
    engine = {"download": 0.1, "decode": 0.6, "resize: daft": 0.95, "resize: torch": 0.75}
    resize_alone = {"daft": 0.3, "torch": 0.12}
    pil = {"read": 0.05, "decode": 0.65, "resize": 1.0}
    table = dataengine.stage_table(engine, resize_alone, pil)
    assert tuple(table) == dataengine.STAGES
    expected = {"bytes": (0.05, 0.1), "decode": (0.6, 0.5), "resize": (0.35, 0.12)}
    for stage, (pil_ms, engine_ms) in expected.items():
        assert table[stage] == pytest.approx((pil_ms, engine_ms))
    assert dataengine.stage_table(engine, resize_alone, pil, resizer="daft")["resize"][1] == pytest.approx(0.3)
    with pytest.raises(ValueError, match="resizer must be one of"):
        dataengine.stage_table(engine, resize_alone, pil, resizer="bicubic")


def test_the_native_runner_can_be_asked_for_twice_in_one_process():
    """Run All twice in one kernel: the second first cell must not fail on Daft's set-once runner."""
    import subprocess
    import sys

    code = "from labkit import dataengine; dataengine.use_native_runner(); dataengine.use_native_runner(); print('ok')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "DAFT_ANALYTICS_ENABLED": "0"})
    assert done.stdout.strip().endswith("ok"), done.stderr


def test_lab2_on_a_gpu_chooses_its_model_as_lab1_does_not_a_fixed_width_32(monkeypatch):
    from labkit import accelerator

    monkeypatch.setattr(accelerator, "ModelStep", lambda device, *, width=32: (str(device), width))
    monkeypatch.setattr(accelerator, "model_width_for", lambda device, **kw: 512)
    sizes = dataengine.SIZES["gpu"]
    assert dataengine.make_accelerator(sizes, "cuda", decode_ms_per_image=0.5, loader_cores=8) == ("cuda", 512)


def test_lab2_on_the_cpu_sizes_lab1s_stand_in_as_lab1_does_from_the_measured_decode():
    from labkit.accelerator import StandInAccelerator
    from labkit.ladder import ACCELERATOR_OVER_LOADER

    accelerator = dataengine.make_accelerator(dataengine.SIZES["ci"], "cpu", decode_ms_per_image=0.5, loader_cores=2)
    assert isinstance(accelerator, StandInAccelerator)
    assert accelerator.images_per_s == pytest.approx(ACCELERATOR_OVER_LOADER * 2 * 1e3 / 0.5)
    with pytest.raises(ValueError, match="decode_ms_per_image must be > 0"):
        dataengine.make_accelerator(dataengine.SIZES["ci"], "cpu", decode_ms_per_image=0, loader_cores=2)
    with pytest.raises(ValueError, match="loader_cores must be >= 1"):
        dataengine.make_accelerator(dataengine.SIZES["ci"], "cpu", decode_ms_per_image=0.5, loader_cores=0)
