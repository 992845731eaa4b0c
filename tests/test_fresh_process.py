"""A measurement in a fresh process: its last line back as JSON, its environment as asked, its failure loud."""

import pytest

from labkit import fresh_process


def test_the_last_line_comes_back_parsed_with_the_environment_asked_for():
    found = fresh_process.run_module("tests.fresh_probe", "MALLOC_MMAP_THRESHOLD_",
                                     env=fresh_process.PEAK_ALLOCATOR_ENV, what="environment probe")
    assert found == {"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}


def test_a_failed_measurement_names_itself_and_shows_its_error():
    with pytest.raises(RuntimeError, match=r"environment probe failed \(python -m tests.fresh_probe, exit 1\)"
                                           r"[\s\S]*KeyError"):
        fresh_process.run_module("tests.fresh_probe", "fail", env={}, what="environment probe")
    with pytest.raises(ValueError, match="module must be named and timeout_s > 0"):
        fresh_process.run_module("", env={}, what="nothing")
