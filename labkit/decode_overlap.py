"""What loader workers buy: decoding beside the accelerator instead of between its steps.

With 0 workers the training loop decodes, then computes, so an image costs both.
With workers decoding in other processes the two overlap, and an image saves at
most the smaller side. These are the pure functions Lab 1 reads its worker sweep
with, and the model behind its explorer: the busy fraction a decode-bound loader
allows, and how many cores it takes to keep an accelerator fed.
"""

from __future__ import annotations

import numpy as np

from labkit.meter import MeterSummary


def hidden_compute_fraction(serial: MeterSummary, overlapped: MeterSummary) -> float:
    """How much of the accelerator's compute time the loader workers hid behind decoding.

    With 0 workers the loop decodes, then computes: per image the wall time is
    decode + compute. With workers decoding in parallel the two overlap, so if the
    loader is the slower side each image saves up to its compute time. Measured
    per image: (serial wall - overlapped wall) / overlapped compute. 1 is a
    perfect overlap, 0 none; unlike the images/s ratio it does not depend on how
    much faster the accelerator is than the loader.
    """
    if serial.items < 1 or overlapped.items < 1 or overlapped.compute_ms <= 0:
        raise ValueError("both summaries need measured items and compute time")
    saved_ms = 1e3 / serial.items_per_s - 1e3 / overlapped.items_per_s
    return saved_ms / (overlapped.compute_ms / overlapped.items)


HIDDEN_SHARE_RESOLVABLE = 0.1
"""Below this :func:`compute_share`, :func:`hidden_compute_fraction` is not measured but noise.

One worker can save each image at most its compute time, and it costs each image
its own overhead (the batch crosses from the worker's process). On an H200 machine
the accelerator's compute was 3% of a 0-worker image's time (0.03 ms of 0.94 ms):
one worker then came out 245% *slower* than hiding nothing, the overhead and the
decode's noise dwarfing what it could hide. On the CPU profile, where the model
is sized to 3x one core's decode, the share is about a quarter; Lab 1's sweep runs
:meth:`labkit.ladder.Ladder.balanced_steps` per batch, which brings it near a half on any machine."""


OVERLAP_BUSY_GAIN = 1.3
"""One worker's busy fraction over no worker's, at least, where the worker overlaps decoding with compute.

Measured with :meth:`labkit.ladder.Ladder.balanced_steps` making compute about equal to decode,
where a perfect overlap doubles the busy fraction: 1.79-2.11 in 9 sweeps on the
quiet 2-core box (3 and 5 rounds). A loader that ignores its workers gives two
identical loaders, a ratio near 1. Before the balancing, the accelerator's compute
was a quarter of an image's time, the ratio could be 1.33 at most, and one CI run
measured 1.22. Lab 1 asserts this ratio rather than :func:`hidden_compute_fraction`,
which is a difference of two wall times and ranged 0.61-1.21 over the same sweeps.
"""


def compute_share(serial: MeterSummary) -> float:
    """The accelerator's share of an image's wall time with 0 workers: the most one worker can hide."""
    if serial.items < 1 or serial.items_per_s <= 0:
        raise ValueError("serial needs measured items and a rate")
    return (serial.compute_ms / serial.items) / (1e3 / serial.items_per_s)


def loader_bound_busy_fraction(accelerator_images_per_s: float, per_worker_images_per_s: float,
                               workers: int) -> float:
    """The best busy fraction a decode-bound loader allows: supply over demand, at most 1.

    With 0 workers the loop decodes between steps, so decode and compute add up
    instead of overlapping.
    """
    if accelerator_images_per_s <= 0 or per_worker_images_per_s <= 0:
        raise ValueError("accelerator_images_per_s and per_worker_images_per_s must be > 0")
    if workers < 0:
        raise ValueError(f"workers must be >= 0, got {workers}")
    if workers == 0:
        compute_s, decode_s = 1 / accelerator_images_per_s, 1 / per_worker_images_per_s
        return compute_s / (compute_s + decode_s)
    return min(1.0, workers * per_worker_images_per_s / accelerator_images_per_s)


def workers_needed(accelerator_images_per_s: float, per_worker_images_per_s: float,
                   target_busy: float = 0.95) -> int:
    """Loader workers (each on its own core) needed to keep the accelerator ``target_busy``."""
    if not 0 < target_busy <= 1:
        raise ValueError(f"target_busy must be in (0, 1], got {target_busy}")
    if accelerator_images_per_s <= 0 or per_worker_images_per_s <= 0:
        raise ValueError("accelerator_images_per_s and per_worker_images_per_s must be > 0")
    return int(np.ceil(target_busy * accelerator_images_per_s / per_worker_images_per_s))


def loader_explorer(per_worker_images_per_s: float, *, accelerator_images_per_s: float = 8000, workers: int = 2):
    """Sliders: how fast is your accelerator, how many workers? -> the busy fraction decoding allows (modelled).

    The sliders start at ``accelerator_images_per_s`` and ``workers``: a lab passes
    what it measured and ran, so the first answer is about its own machine.
    """
    import ipywidgets as widgets

    from labkit.widgets import live

    if accelerator_images_per_s <= 0 or workers < 0:
        raise ValueError(f"accelerator_images_per_s must be > 0 and workers >= 0, got {accelerator_images_per_s} "
                         f"and {workers}")

    def render(accelerator_images_per_s: float, workers: int) -> str:
        busy = loader_bound_busy_fraction(accelerator_images_per_s, per_worker_images_per_s, workers)
        need = workers_needed(accelerator_images_per_s, per_worker_images_per_s)
        return (f"modelled: decode-bound busy fraction {busy:.2f}; workers (each with a core) needed for 0.95: "
                f"{need} at {per_worker_images_per_s:.0f} images/s per worker")

    return live(render, {
        "accelerator_images_per_s": widgets.FloatLogSlider(value=accelerator_images_per_s, base=10, min=2, max=5.5,
                                                           description="accel img/s"),
        "workers": widgets.IntSlider(value=workers, min=0, max=64, description="workers"),
    })
