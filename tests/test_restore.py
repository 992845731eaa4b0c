"""Restoring the newest save from the async saver's in-memory copy and from the store (Lab 7)."""

import pytest

from labkit import restore


def test_both_restores_are_bit_identical_and_the_store_pays_its_rate(tmp_path):
    race = restore.restore_race(tmp_path, state_mb=8, bytes_per_s=40e6, first_byte_ms=10, rounds=1)
    assert race.memory.identical and race.store.identical
    assert race.memory.bytes == race.store.bytes > 8e6
    assert race.store.seconds >= race.store.bytes / 40e6 + 0.010
    assert race.speedup() > 1


def test_bad_sizes_are_refused(tmp_path):
    with pytest.raises(ValueError, match="rounds >= 1"):
        restore.restore_race(tmp_path, state_mb=8, rounds=0)
