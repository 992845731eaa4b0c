"""Lab 2's catalog: Daft's filters agree with a plain-Python recount, and bad catalogs say what is wrong."""

import os

import daft
import pyarrow.parquet as pq
import pytest

from labkit import catalog

SELECTIONS = [
    catalog.Selection(),
    catalog.Selection(split=None, drop_degraded=False),
    catalog.Selection(split="val", drop_degraded=False, min_quality=0.5),
    catalog.Selection(split=None, min_side_px=200, max_side_px=250),
]


@pytest.mark.parametrize("selection", SELECTIONS, ids=lambda s: repr(s))
def test_daft_filter_count_matches_a_plain_python_recount(small_dataset, selection):
    frame = catalog.read_catalog(small_dataset)
    engine_count = catalog.select(frame, selection).count_rows()
    assert engine_count == catalog.recount(catalog.catalog_rows(small_dataset), selection)


def test_dropping_degraded_images_removes_exactly_the_degraded_rows(small_dataset):
    rows = catalog.catalog_rows(small_dataset)
    kept = catalog.select(catalog.read_catalog(small_dataset), catalog.Selection(split=None))
    assert kept.count_rows() == sum(1 for row in rows if not row["degraded"])
    assert kept.where(daft.col("degraded")).count_rows() == 0


def test_counts_per_class_add_up_to_the_catalog(small_dataset):
    counts = catalog.counts_by(catalog.read_catalog(small_dataset), "label_name")
    assert sum(counts.values()) == small_dataset.num_images
    recount: dict[str, int] = {}
    for row in catalog.catalog_rows(small_dataset):
        recount[row["label_name"]] = recount.get(row["label_name"], 0) + 1
    assert counts == recount


def test_quality_histogram_counts_every_row_in_its_bin(small_dataset):
    bins = 5
    histogram = catalog.quality_histogram(catalog.read_catalog(small_dataset), bins)
    expected = [0] * bins
    for row in catalog.catalog_rows(small_dataset):
        expected[min(int(row["quality"] * bins), bins - 1)] += 1
    assert histogram == expected and len(catalog.bin_edges(bins)) == bins


def test_degraded_images_score_lower_quality(small_dataset):
    rows = catalog.catalog_rows(small_dataset)
    degraded = [row["quality"] for row in rows if row["degraded"]]
    clean = [row["quality"] for row in rows if not row["degraded"]]
    assert degraded and clean
    assert sum(degraded) / len(degraded) < sum(clean) / len(clean)


def test_catalog_missing_a_column_names_the_column(small_dataset, tmp_path):
    damaged = tmp_path / "catalog.parquet"
    pq.write_table(small_dataset.catalog().drop_columns(["quality"]), damaged)
    with pytest.raises(catalog.CatalogError, match="'quality'"):
        catalog.read_catalog(damaged)


def test_missing_catalog_file_names_the_file_and_the_fix(tmp_path):
    with pytest.raises(catalog.CatalogError, match="does not exist.*generate"):
        catalog.read_catalog(tmp_path / "nowhere.parquet")


def _catalog_with_a_lost_file(small_dataset, tmp_path):
    table = small_dataset.catalog()
    lost = str(tmp_path / "lost.jpg")
    paths = [lost] + table.column("path").to_pylist()[1:]
    target = tmp_path / "catalog.parquet"
    pq.write_table(table.set_column(1, "path", [paths]), target)
    return target, lost


def test_a_path_that_no_longer_exists_is_named(small_dataset, tmp_path):
    target, lost = _catalog_with_a_lost_file(small_dataset, tmp_path)
    with pytest.raises(catalog.CatalogError, match="lost.jpg"):
        catalog.check_paths(catalog.read_catalog(target))


def test_dropping_missing_paths_counts_them(small_dataset, tmp_path):
    target, lost = _catalog_with_a_lost_file(small_dataset, tmp_path)
    checked = catalog.check_paths(catalog.read_catalog(target), on_missing="drop")
    assert checked.missing == (lost,)
    assert checked.checked == small_dataset.num_images
    assert checked.frame.count_rows() == small_dataset.num_images - 1
    assert all(os.path.exists(p) for p in checked.frame.select("path").to_pydict()["path"])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"split": "training"}, "split must be one of"),
        ({"min_quality": 1.5}, "min_quality must be in"),
        ({"min_side_px": -1}, "min_side_px must be >= 0"),
        ({"min_side_px": 200, "max_side_px": 100}, "max_side_px must be >= min_side_px"),
    ],
)
def test_bad_selection_names_the_argument_and_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        catalog.Selection(**kwargs)


def test_bad_arguments_are_named(small_dataset):
    frame = catalog.read_catalog(small_dataset)
    with pytest.raises(ValueError, match="column must be one of"):
        catalog.counts_by(frame, "colour")
    with pytest.raises(ValueError, match="bins must be >= 1"):
        catalog.quality_histogram(frame, 0)
    with pytest.raises(ValueError, match="on_missing must be"):
        catalog.check_paths(frame, on_missing="ignore")


def test_decoding_the_images_takes_the_bytes_the_catalog_says(small_dataset, tmp_path):
    frame = catalog.read_catalog(small_dataset)
    rows = frame.limit(16).to_pydict()
    decoded = catalog.decoded_bytes(rows["path"])
    assert decoded == sum(w * h * 3 for w, h in zip(rows["width"], rows["height"]))
    assert decoded / sum(rows["bytes"]) == pytest.approx(catalog.decoded_inflation(frame.limit(16)))
    from PIL import Image

    smaller = tmp_path / "smaller.jpg"
    with Image.open(rows["path"][0]) as image:
        image.resize((image.width // 2, image.height // 2)).save(smaller)
    assert catalog.decoded_bytes([str(smaller)]) < rows["width"][0] * rows["height"][0] * 3, \
        "a file that no longer matches its catalog row decodes to other bytes"


def test_kept_decoded_images_take_their_bytes_in_memory_and_a_stream_takes_a_batch(small_dataset):
    paths, _ = small_dataset.paths_and_labels()
    peaks = catalog.decode_peaks(paths[:128], batch=8)
    assert peaks.decoded_bytes > 5 * peaks.jpeg_bytes
    assert peaks.materialised_bytes >= 0.8 * peaks.decoded_bytes
    assert peaks.streamed_bytes < 0.3 * peaks.materialised_bytes
    with pytest.raises(ValueError, match="batch must be >= 1"):
        catalog.decode_peaks(paths[:4], batch=0)
