import pyarrow as pa
import pyarrow.dataset  # noqa: F401 -- pa.dataset
import pyarrow.parquet as pq
import pytest
import torch

from labkit import arrow_conversion, dataset, loaders


@pytest.fixture(scope="module")
def slice_file(tmp_path_factory):
    data = dataset.generate(64)
    paths, labels = (column[:24] for column in data.paths_and_labels())
    target = tmp_path_factory.mktemp("parquet") / "slice.parquet"
    return arrow_conversion.write_slice(paths, labels, target, row_group_size=8), paths, labels


def _epoch(path, conversion, *, epoch=0, image_px=16):
    log = arrow_conversion.ReaderLog()
    batches = list(arrow_conversion.ParquetBatches(path, conversion=conversion, image_px=image_px, log=log, epoch=epoch))
    return batches, log


def test_slice_holds_each_image_once_at_its_stored_size(slice_file):
    path, paths, labels = slice_file
    table = pq.read_table(path)
    assert table.num_rows == len(paths) and pq.ParquetFile(path).num_row_groups == 3
    assert sorted(table.column("index").to_pylist()) == list(range(len(paths)))
    row = table.slice(0, 1).to_pylist()[0]
    assert row["label"] == labels[row["index"]]
    assert len(row["pixels"]) == row["height"] * row["width"] * 3 and row["height"] >= 160


def test_an_existing_slice_is_reused_and_another_row_group_size_rewritten(slice_file):
    path, paths, labels = slice_file
    written = path.stat().st_mtime_ns
    assert arrow_conversion.write_slice(paths, labels, path, row_group_size=8) == path
    assert path.stat().st_mtime_ns == written
    other = path.with_name("other.parquet")
    arrow_conversion.write_slice(paths, labels, other, row_group_size=12)
    assert pq.ParquetFile(other).num_row_groups == 2


def test_both_readers_deliver_the_same_batches(slice_file):
    path, paths, _ = slice_file
    rowwise, rowwise_log = _epoch(path, "row-wise")
    columnar, columnar_log = _epoch(path, "columnar")
    assert len(rowwise) == 3 and rowwise_log.images == columnar_log.images == len(paths)
    for (a_images, a_labels), (b_images, b_labels) in zip(rowwise, columnar):
        assert torch.equal(a_images, b_images) and torch.equal(a_labels, b_labels)
        assert a_images.dtype == torch.uint8 and a_images.shape[1:] == (3, 16, 16)
    assert rowwise_log.digests == columnar_log.digests
    assert _epoch(path, "row-wise", epoch=1)[1].digests != rowwise_log.digests   # another order, other flips


def test_pixels_are_the_file_loaders_resize_flipped_by_the_same_rule(slice_file):
    path, paths, _ = slice_file
    index = pq.read_table(path).column("index").to_numpy()
    (images, _), *_ = _epoch(path, "columnar", epoch=2)[0]
    group = int(loaders.shuffled_order(3, 0, 2)[0])
    for k, i in enumerate(index[group * 8:(group + 1) * 8]):
        pixels = torch.from_numpy(loaders.decode(open(paths[i], "rb").read(), 16).transpose(2, 0, 1).copy())
        assert torch.equal(images[k], pixels.flip(-1) if loaders.flip_decision(0, 2, int(i)) else pixels)


def test_the_log_splits_time_by_stage(slice_file):
    path, *_ = slice_file
    _, rowwise = _epoch(path, "row-wise")
    _, columnar = _epoch(path, "columnar")
    assert set(rowwise.ms_per_image()) == set(arrow_conversion.STAGES)
    assert all(ms > 0 for ms in rowwise.ms_per_image().values())
    assert columnar.ms_per_image()["convert"] < rowwise.ms_per_image()["convert"]
    assert "convert" in rowwise.describe()
    assert arrow_conversion.ReaderLog().ms_per_image()["read"] == 0.0


def test_the_readers_read_through_read_pool_not_arrows_default(slice_file, monkeypatch):
    """mimalloc, Arrow's default, charged the first reader of a process about 2 s of huge-page faults as its read."""
    path, *_ = slice_file
    assert arrow_conversion.read_pool().backend_name in ("jemalloc", "system")
    watched = pa.proxy_memory_pool(arrow_conversion.read_pool())
    monkeypatch.setattr(arrow_conversion, "read_pool", lambda: watched)
    _epoch(path, "row-wise")
    assert watched.max_memory() > 0


def test_the_columnar_reader_views_the_pixel_column_without_a_copy(slice_file):
    path, *_ = slice_file
    (fragment,) = pa.dataset.dataset(path, format="parquet").get_fragments()
    table = fragment.split_by_row_group()[0].to_table(memory_pool=arrow_conversion.read_pool())
    default, watched = pa.default_memory_pool(), pa.proxy_memory_pool(pa.default_memory_pool())
    pa.set_memory_pool(watched)
    try:
        arrow_conversion.columnar(table, arrow_conversion.ReaderLog(), image_px=16, seed=0, epoch=0)
    finally:
        pa.set_memory_pool(default)
    assert watched.max_memory() < table.column("pixels").nbytes / 2


def test_bad_arguments_are_named(slice_file, tmp_path):
    path, paths, labels = slice_file
    with pytest.raises(ValueError, match="conversion must be one of"):
        arrow_conversion.ParquetBatches(path, conversion="pandas", image_px=16, log=arrow_conversion.ReaderLog())
    with pytest.raises(ValueError, match="image_px must be >= 1"):
        arrow_conversion.ParquetBatches(path, conversion="columnar", image_px=0, log=arrow_conversion.ReaderLog())
    with pytest.raises(ValueError, match="row_group_size must be >= 1"):
        arrow_conversion.write_slice(paths, labels, tmp_path / "x.parquet", row_group_size=0)
    with pytest.raises(ValueError, match="paths and labels"):
        arrow_conversion.write_slice(paths, labels[:3], tmp_path / "x.parquet", row_group_size=4)
    with pytest.raises(ValueError, match="stage must be one of"):
        with arrow_conversion.ReaderLog().timing("decode"):
            pass
    assert list(tmp_path.iterdir()) == []
