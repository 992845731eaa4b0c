"""Lab 3's memory hierarchy: a working set that fits a cache is read faster than one that lives in DRAM."""

import pytest

from labkit import cache_sweep as cs

KIB, MIB = 2**10, 2**20
CACHES = {"L1d": 32 * KIB, "L2": 512 * KIB, "L3": 8 * MIB}


def _sweep(gb_per_s: dict[int, float]) -> cs.CacheSweep:
    return cs.CacheSweep("cpu", [cs.CachePoint(size, rate * 1e9) for size, rate in gb_per_s.items()], CACHES)


def test_the_working_sets_run_from_a_few_kib_to_beyond_the_last_cache():
    sizes = cs.working_sets(CACHES)
    assert sizes[0] == 16 * KIB and sizes[-1] == 64 * MIB and all(b == 2 * a for a, b in zip(sizes, sizes[1:]))
    with pytest.raises(ValueError, match="smallest must be > 0 bytes"):
        cs.working_sets(CACHES, smallest=0)


def test_the_gain_is_the_best_in_cache_rate_over_the_best_rate_from_dram():
    sweep = _sweep({16 * KIB: 60, 256 * KIB: 58, 2 * MIB: 35, 8 * MIB: 7, 32 * MIB: 9, 64 * MIB: 8})
    assert sweep.cache_gain() == pytest.approx(60 / 9)
    assert sweep.bandwidth_at(7 * MIB) == 7e9
    said = " ".join(cs.hierarchy_sentences(sweep))
    assert "up to 60.0 GB/s (16 KiB), 6.67x faster" in said and "9.0 GB/s at 32 MiB; L3 holds 8 MiB" in said
    with pytest.raises(ValueError, match="needs points inside L2 and beyond 4x the last cache"):
        _sweep({16 * KIB: 60}).cache_gain()


def test_cache_sizes_are_read_from_the_kernel(tmp_path, monkeypatch):
    for index, (kind, level, size) in enumerate([("Data", 1, "32K"), ("Instruction", 1, "64K"), ("Unified", 2, "512K"),
                                                 ("Unified", 3, "8192K")]):
        folder = tmp_path / f"index{index}"
        folder.mkdir()
        for name, value in (("type", kind), ("level", level), ("size", size)):
            (folder / name).write_text(f"{value}\n")
    monkeypatch.setattr(cs, "SYSFS_CACHES", tmp_path)
    assert cs.cache_sizes("cpu") == CACHES
    monkeypatch.setattr(cs, "SYSFS_CACHES", tmp_path / "missing")
    assert cs.cache_sizes("cpu") == {}


def test_a_small_measured_sweep_reads_every_size():
    sweep = cs.measure("cpu", [16 * KIB, 64 * MIB])
    assert [p.working_set_bytes for p in sweep.points] == [16 * KIB, 64 * MIB]
    assert all(p.bytes_per_s > 0 for p in sweep.points)
