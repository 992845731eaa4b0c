"""The race of the PIL DataLoader and the Daft pipeline over the object store (Lab 2)."""

import pytest

from labkit import dataengine, store_race


@pytest.fixture(scope="module")
def images(small_dataset):
    paths, labels = small_dataset.paths_and_labels()
    return small_dataset.root, paths[:24], labels[:24]


def test_both_loaders_at_both_latencies_one_get_per_image_counted_by_the_server(images):
    dataengine.use_native_runner()
    root, paths, labels = images
    race = store_race.race(root, paths, labels, latency_ms=5, workers=1, image_px=8, batch_size=8, rounds=1)
    assert sorted(race.runs) == sorted((loader, ms) for loader in store_race.LOADERS for ms in (0.0, 5))
    for run in race.runs.values():
        assert run.images == run.requests == 24 and run.seconds > 0
    assert race.run("PIL DataLoader", 5).connections == 1
    assert race.run("PIL DataLoader + GET threads", 5).connections == store_race.GET_THREADS
    assert race.little_bound() == 200
    # One worker, one request in flight: the loader cannot beat 1 / 5 ms.
    assert race.run("PIL DataLoader", 5).images_per_s <= race.little_bound()
    for loader in store_race.LOADERS:   # what the server held at once bounds what it answers
        run = race.run(loader, 5)
        assert run.images_per_s <= 1.05 * run.little_bound(), run.as_row()
    assert race.run("PIL DataLoader", 5).in_flight <= 1.05


def test_bad_input_names_the_argument(images):
    root, paths, labels = images
    with pytest.raises(ValueError, match="latency_ms must be > 0"):
        store_race.race(root, paths, labels, latency_ms=0, workers=1, image_px=8, batch_size=8)
    with pytest.raises(ValueError, match="workers must be >= 1, got 0"):
        store_race.race(root, paths, labels, latency_ms=5, workers=0, image_px=8, batch_size=8)
    with pytest.raises(ValueError, match="labels must have one entry per path: 23 labels for 24 paths"):
        store_race.race(root, paths, labels[:-1], latency_ms=5, workers=1, image_px=8, batch_size=8)
    with pytest.raises(ValueError, match="paths must name at least one object"):
        store_race.race(root, [], [], latency_ms=5, workers=1, image_px=8, batch_size=8)
    with pytest.raises(ValueError, match="loader must be one of"):
        store_race.measure(None, "Ray Data", paths, labels, workers=1, image_px=8, batch_size=8)
