"""Reference answers to Lab 3's exercises."""

from labkit import roofline
from labkit.exercises import Answer


def _per_batch_ms(result, slower) -> tuple[float, float]:
    """(copy, compute) ms of one batch: the copy at the slower link's rate, compute as measured serially."""
    copy_ms = slower.batch_rows * slower.features * 4 / slower.link_bytes_per_s * 1e3
    return copy_ms, result.serial.busy_ms("compute") / slower.batches


def _overlapped_ms(result, slower) -> float:
    """One copy, then batches - 1 steps at the slower of copy and compute, then the last compute."""
    copy_ms, compute_ms = _per_batch_ms(result, slower)
    return copy_ms + (slower.batches - 1) * max(copy_ms, compute_ms) + compute_ms


def _serial_ms(result, slower) -> float:
    return slower.batches * sum(_per_batch_ms(result, slower))


EX_3_2 = Answer(right=_overlapped_ms, wrong=_serial_ms,
                wrong_because="adds copy and compute for every batch: the serial pipeline, not the overlapped one")

EX_3_1 = Answer(
    right=roofline.attainable_flops_per_s,
    wrong=lambda intensity, peak, bandwidth: intensity * bandwidth,
    wrong_because="the memory roof alone: past the ridge the compute units cap FLOP/s",
)
