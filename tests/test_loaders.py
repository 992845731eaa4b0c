"""Lab 1's loaders: same batches from every rung, deterministic, and honest emulations."""

import time

import numpy as np
import pytest
import torch

from labkit import ladder, loaders
from labkit.profiles import profile


def test_decode_returns_training_resolution_pixels(small_dataset):
    path = small_dataset.catalog().column("path")[0].as_py()
    data = open(path, "rb").read()
    for draft in (False, True):
        pixels = loaders.decode(data, 32, draft=draft)
        assert pixels.shape == (32, 32, 3) and pixels.dtype == np.uint8
    with pytest.raises(ValueError, match="image_px must be >= 1"):
        loaders.decode(data, 0)


def test_every_rung_yields_the_same_labels_in_the_same_order(small_dataset, tmp_path):
    paths, labels = small_dataset.paths_and_labels()
    files = [y.tolist() for _, y in loaders.file_loader(paths, labels, batch_size=16, num_workers=2)]
    cache = loaders.RawCache.fill(loaders.RemoteStore(paths, latency_ms=0), len(paths))
    raw = [y.tolist() for _, y in cache.loader(labels, batch_size=16, num_workers=0)]
    transformed = loaders.TransformedCache.build(paths, labels, tmp_path / "c.npy", image_px=32)
    cached = [y.tolist() for _, y in transformed.loader(batch_size=16)]
    assert files == raw == cached


def test_transformed_cache_holds_the_pixels_the_file_path_would_decode(small_dataset, tmp_path):
    paths, labels = small_dataset.paths_and_labels()
    cache = loaders.TransformedCache.build(paths, labels, tmp_path / "c.npy", image_px=32)
    from_files = next(iter(loaders.file_loader(paths, labels, batch_size=8, num_workers=0, draft=True)))[0]
    from_cache = next(iter(cache.loader(batch_size=8)))[0]
    assert torch.equal(from_files, from_cache)
    assert cache.nbytes >= len(paths) * 3 * 32 * 32


def test_per_sample_flips_do_not_depend_on_worker_count(small_dataset):
    paths, labels = small_dataset.paths_and_labels()
    batches = lambda workers: [x for x, _ in loaders.file_loader(paths, labels, batch_size=16, num_workers=workers)]
    assert all(torch.equal(a, b) for a, b in zip(batches(0), batches(2)))


def test_flip_decisions_are_balanced_and_epoch_dependent():
    first = loaders.flip_decisions(0, 0, np.arange(20_000))
    assert 0.48 < first.mean() < 0.52
    assert (first != loaders.flip_decisions(0, 1, np.arange(20_000))).mean() > 0.4


def test_remote_store_emulates_latency_without_using_cpu(small_dataset):
    paths, _ = small_dataset.paths_and_labels()
    store = loaders.RemoteStore(paths, latency_ms=20)
    wall, cpu = time.perf_counter(), time.process_time()
    store(0)
    assert time.perf_counter() - wall >= 0.019
    assert time.process_time() - cpu < 0.01
    with pytest.raises(ValueError, match="latency_ms must be >= 0"):
        loaders.RemoteStore(paths, latency_ms=-1)


def test_stand_in_accelerator_takes_time_but_no_cpu():
    stand_in = loaders.StandInAccelerator(images_per_s=1000)
    wall, cpu = time.perf_counter(), time.process_time()
    stand_in.step(torch.zeros(50, 3, 8, 8))
    assert time.perf_counter() - wall >= 0.049
    assert time.process_time() - cpu < 0.01
    with pytest.raises(ValueError, match="images_per_s must be > 0"):
        loaders.StandInAccelerator(0)


def test_naive_sharded_loading_skews_labels_and_labkit_does_not(small_dataset):
    paths, labels = small_dataset.paths_and_labels()
    naive = loaders.naive_parallel_batches(paths, labels, batch_size=20, workers=2)
    ours = ladder.deterministic_batches(paths, labels, batch_size=20, workers=2)
    assert loaders.batch_label_skew(naive, 10) > 2 * loaders.batch_label_skew([b.labels for b in ours], 10)
    assert sorted(sum(naive, [])) == sorted(labels)


def test_labkit_batches_carry_the_same_pixels_and_flips_for_any_worker_count(small_dataset, monkeypatch):
    paths, labels = small_dataset.paths_and_labels()
    by_workers = [ladder.deterministic_batches(paths[:60], labels[:60], batch_size=20, workers=w) for w in (0, 2)]
    assert by_workers[0] == by_workers[1]
    monkeypatch.setattr(loaders, "flip_decision", lambda seed, epoch, index: bool(index % 2))
    flipped_otherwise = ladder.deterministic_batches(paths[:60], labels[:60], batch_size=20, workers=0)
    assert [b.labels for b in flipped_otherwise] == [b.labels for b in by_workers[0]]
    assert flipped_otherwise != by_workers[0], "the digest must see a change of flips that labels cannot"


def test_pil_stage_costs_charge_every_cut_and_decode_costs_more_than_the_read(small_dataset):
    paths, _ = small_dataset.paths_and_labels()
    costs = loaders.stage_costs(paths[:64], 16, repeats=1)
    assert tuple(costs) == loaders.PIL_CUTS
    assert all(ms > 0 for ms in costs.values())
    assert costs["decode"] > costs["read"]
    with pytest.raises(ValueError, match="at least one image"):
        loaders.stage_costs([], 16)
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        loaders.stage_costs(paths[:1], 16, repeats=0)


def test_loader_arguments_are_checked(small_dataset):
    paths, labels = small_dataset.paths_and_labels()
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        loaders.file_loader(paths, labels, batch_size=0)
    with pytest.raises(ValueError, match="same length"):
        loaders.file_loader(paths, labels[:-1], batch_size=4)
    with pytest.raises(TypeError, match="unknown loader arguments"):
        loaders.RawCache([b""]).loader([0], batch=4)
    with pytest.raises(ValueError, match="workers must be >= 0"):
        ladder.LadderSizes(num_images=10, image_px=32, batch_size=4, workers=-1, stand_in_images_per_s=1,
                           remote_latency_ms=0, remote_images=1, fast_epochs=1)


def test_the_ladder_measures_each_rung(small_dataset):
    sizes = ladder.LadderSizes(num_images=120, image_px=32, batch_size=20, workers=1,
                               stand_in_images_per_s=2000, remote_latency_ms=2, remote_images=40, fast_epochs=1)
    run = ladder.Ladder(small_dataset, sizes, ladder.accelerator_for(profile("ci"), sizes))
    run.in_ram()
    run.remote()
    assert set(run.results) == {"in RAM", "remote, no cache"}
    assert run.results["in RAM"].busy_fraction > run.results["remote, no cache"].busy_fraction
    assert [row["rung"] for row in run.table()] == ["in RAM", "remote, no cache"]


def test_decode_bound_busy_fraction_is_supply_over_demand():
    assert ladder.loader_bound_busy_fraction(8000, 1000, 2) == 0.25
    assert ladder.loader_bound_busy_fraction(1000, 1000, 4) == 1.0
    assert ladder.loader_bound_busy_fraction(1000, 1000, 0) == 0.5
    assert ladder.workers_needed(8000, 1000, target_busy=0.95) == 8
    with pytest.raises(ValueError, match="target_busy must be in"):
        ladder.workers_needed(8000, 1000, target_busy=0)
    with pytest.raises(ValueError, match="workers must be >= 0"):
        ladder.loader_bound_busy_fraction(8000, 1000, -1)


def test_loader_explorer_shows_the_pure_functions_answer():
    current = ladder.loader_explorer(1000)
    assert "busy fraction: 0.25" in current() and "needed for 0.95: 8 " in current()
