"""The generated dataset: deterministic, realistic, atomic, and loud when damaged."""

import pyarrow.parquet as pq
import pytest

from labkit import dataset


def test_catalog_has_the_documented_schema(small_dataset):
    table = small_dataset.catalog()
    assert table.schema == dataset.SCHEMA
    assert table.num_rows == 120
    assert set(table.column("label_name").to_pylist()) == set(dataset.CLASSES)


def test_images_are_realistic_jpegs_of_a_few_sizes(small_dataset):
    table = small_dataset.catalog()
    sizes = set(zip(table.column("width").to_pylist(), table.column("height").to_pylist()))
    assert sizes <= {(s, s) for s in dataset.SIDES_PX} and len(sizes) >= 2
    clean_bytes = [b for b, d in zip(table.column("bytes").to_pylist(), table.column("degraded").to_pylist()) if not d]
    assert 4_000 < sum(clean_bytes) / len(clean_bytes) < 60_000


def test_degraded_images_score_lower_quality(small_dataset):
    table = small_dataset.catalog().to_pylist()
    degraded = [r["quality"] for r in table if r["degraded"]]
    clean = [r["quality"] for r in table if not r["degraded"]]
    assert degraded, "about one image in ten is degraded"
    assert sum(degraded) / len(degraded) < 0.6 * sum(clean) / len(clean)


def test_generation_is_deterministic_and_idempotent(data_root):
    first = dataset.generate(30, progress=False)
    before = first.catalog_path.stat().st_mtime_ns
    again = dataset.generate(30, progress=False)
    assert again.catalog_path.stat().st_mtime_ns == before
    other = dataset.generate(30, name="copy", progress=False)
    strip = lambda t: t.drop_columns(["path"])
    assert strip(first.catalog()).equals(strip(other.catalog()))


def test_files_sit_in_one_folder_per_class(small_dataset):
    for row in small_dataset.catalog().to_pylist()[:20]:
        assert f"/images/{row['label_name']}/" in row["path"]


def test_missing_dataset_names_the_fix(data_root):
    with pytest.raises(dataset.DatasetError, match="generate"):
        dataset.load("never-made")


def test_a_deleted_image_is_reported_by_path(data_root):
    made = dataset.generate(20, progress=False)
    victim = made.catalog().column("path")[3].as_py()
    import os

    os.remove(victim)
    with pytest.raises(dataset.DatasetError, match=victim):
        dataset.load(made.name)


def test_a_corrupt_catalog_is_reported(data_root):
    made = dataset.generate(20, progress=False)
    made.catalog_path.write_bytes(b"not parquet")
    with pytest.raises(dataset.DatasetError, match="unreadable"):
        dataset.load(made.name)


def test_interrupted_generation_leaves_nothing_behind(data_root, monkeypatch):
    def explode(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pq, "write_table", explode)
    with pytest.raises(KeyboardInterrupt):
        dataset.generate(15, progress=False)
    assert list(data_root.iterdir()) == []


@pytest.mark.parametrize("kwargs", [dict(num_images=3), dict(num_images=20, seed=-1)])
def test_bad_sizes_name_the_argument(data_root, kwargs):
    with pytest.raises(ValueError, match="num_images|seed"):
        dataset.generate(progress=False, **kwargs)
