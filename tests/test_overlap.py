"""Overlap of copies with compute: both pipelines do the same work; the overlapped one hides copies."""

import pytest
import torch

from labkit import overlap

SMALL = overlap.OverlapSizes(batches=6, batch_rows=512, features=512, compute_width=16, repeats=1)


def test_both_pipelines_copy_and_compute_every_batch():
    batches, weight = overlap.make_workload("cpu", SMALL)
    for pipeline in (overlap.serial_pipeline, overlap.overlapped_pipeline):
        run = pipeline(batches, weight)
        kinds = [label for label, _, _ in run.spans]
        assert kinds.count("copy") == kinds.count("compute") == SMALL.batches
        assert run.total_ms > 0


def test_serial_pipeline_never_runs_a_copy_during_compute():
    batches, weight = overlap.make_workload("cpu", SMALL)
    run = overlap.serial_pipeline(batches, weight)
    ordered = sorted(run.spans, key=lambda s: s[1])
    for (_, start, duration), (_, next_start, _) in zip(ordered, ordered[1:]):
        assert start + duration <= next_start + 1e-6


def test_overlapped_pipeline_starts_a_copy_before_the_previous_compute_ends():
    batches, weight = overlap.make_workload("cpu", SMALL)
    run = overlap.overlapped_pipeline(batches, weight)
    copies = sorted((s for s in run.spans if s[0] == "copy"), key=lambda s: s[1])
    computes = sorted((s for s in run.spans if s[0] == "compute"), key=lambda s: s[1])
    # the prefetcher copies batch 1 while batch 0 computes, bounded by two buffers
    assert copies[1][1] < computes[0][1] + computes[0][2]
    for i in range(2, SMALL.batches):
        assert copies[i][1] >= computes[i - 2][1] + computes[i - 2][2] - 1e-6


def test_overlapped_results_equal_serial_results():
    batches, weight = overlap.make_workload("cpu", SMALL)
    assert torch.equal(overlap.compute(batches[0], weight), overlap.compute(batches[0].clone(), weight))


def test_compare_gives_timeline_rows_for_both_modes():
    result = overlap.compare("cpu", SMALL)
    rows = overlap.timeline_spans(result)
    labels = {label for label, *_ in rows}
    assert labels == {"serial: copy", "serial: compute", "overlapped: copy", "overlapped: compute"}
    assert result.speedup > 0


def test_bad_sizes_name_the_argument():
    with pytest.raises(ValueError, match="batches must be >= 1"):
        overlap.make_workload("cpu", overlap.OverlapSizes(0, 1, 1, 1, 1))
    batches, weight = overlap.make_workload("cpu", SMALL)
    with pytest.raises(ValueError, match="compute_threads must be >= 1"):
        overlap.serial_pipeline(batches, weight, compute_threads=0)


def test_only_the_overlapped_pipeline_has_copies_in_flight_during_compute():
    # Copies paced to a 200 MB/s link last 5 ms each, so the prefetcher is mid-copy whenever a
    # compute starts. Raw 1 MB memcpys (0.1 ms) could finish before the main thread woke: on a
    # loaded 2-core CI box that left no overlap at all once (``assert 0.0 > 0``).
    sizes = overlap.OverlapSizes(batches=6, batch_rows=512, features=512, compute_width=16, repeats=1,
                                 link_bytes_per_s=200e6)
    batches, weight = overlap.make_workload("cpu", sizes)
    assert overlap.serial_pipeline(batches, weight, link_bytes_per_s=sizes.link_bytes_per_s).concurrent_ms() == 0
    overlapped = overlap.overlapped_pipeline(batches, weight, link_bytes_per_s=sizes.link_bytes_per_s)
    assert overlapped.concurrent_ms() > 0


def test_overlaps_shorter_than_the_timer_resolution_are_rounding():
    touching = [("copy", 0.0, 1.0005), ("compute", 1.0, 2.0)]
    assert overlap.PipelineRun("serial", 3.0, touching, resolution_ms=0.002).concurrent_ms() == 0
    assert overlap.PipelineRun("serial", 3.0, touching).concurrent_ms() > 0


def test_emulated_link_paces_the_copy_to_its_rate_and_copies_every_byte():
    src = torch.randn(2**20)
    dst = torch.empty_like(src)
    import time

    start = time.perf_counter()
    overlap.link_copy(dst, src, link_bytes_per_s=400e6)
    assert time.perf_counter() - start >= 4 * 2**20 / 400e6
    assert torch.equal(dst, src)


def test_a_non_positive_link_rate_is_refused():
    with pytest.raises(ValueError, match="link_bytes_per_s must be > 0"):
        overlap.make_workload("cpu", overlap.OverlapSizes(1, 1, 1, 1, 1, link_bytes_per_s=0))
