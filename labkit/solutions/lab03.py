"""Reference answers to Lab 3's exercises."""

from labkit.exercises import Answer


def _overlapped_ms(result, slower) -> float:
    """One copy, then batches - 1 steps at the slower of copy and compute, then the last compute."""
    n = slower.batches
    copy_ms = slower.batch_rows * slower.features * 4 / slower.link_bytes_per_s * 1e3
    compute_ms = result.serial.busy_ms("compute") / n
    return copy_ms + (n - 1) * max(copy_ms, compute_ms) + compute_ms


def _serial_ms(result, slower) -> float:
    n = slower.batches
    copy_ms = slower.batch_rows * slower.features * 4 / slower.link_bytes_per_s * 1e3
    return n * (copy_ms + result.serial.busy_ms("compute") / n)


EX_3_1 = Answer(right=_overlapped_ms, wrong=_serial_ms,
                wrong_because="adds copy and compute for every batch: the serial pipeline, not the overlapped one")

EX_3_2 = Answer(
    right=lambda intensity, peak, bandwidth: min(peak, intensity * bandwidth),
    wrong=lambda intensity, peak, bandwidth: intensity * bandwidth,
    wrong_because="the memory roof alone: past the ridge the compute units cap FLOP/s",
)
