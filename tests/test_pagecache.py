import os

import numpy as np
import pytest

from labkit import pagecache


@pytest.mark.skipif(pagecache.disk_read_bytes() is None or not hasattr(os, "posix_fadvise"),
                    reason="this kernel does not count a process's reads from storage, or cannot drop a file's pages")
def test_a_dropped_file_is_read_from_storage_and_a_cached_one_is_not(tmp_path):
    path = tmp_path / "pixels.npy"
    np.save(path, np.random.default_rng(0).integers(0, 255, size=(2000, 3, 32, 32), dtype=np.uint8))
    size = path.stat().st_size

    def read_counted() -> int:
        before = pagecache.disk_read_bytes()
        mapped = np.load(path, mmap_mode="r")
        int(mapped[::7].sum())   # every page: rows of 3 KiB, one in seven
        del mapped
        return pagecache.disk_read_bytes() - before

    assert pagecache.drop(path)
    assert read_counted() >= 0.9 * size, "after the drop every page comes from storage"
    assert read_counted() < 0.1 * size, "read again at once, the page cache serves it"


def test_counting_is_a_number_or_none():
    counted = pagecache.disk_read_bytes()
    assert counted is None or counted >= 0
