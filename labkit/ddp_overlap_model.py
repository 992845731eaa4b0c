"""The model and the pictures of Lab 5's overlap experiment (:mod:`labkit.ddp_overlap` measures).

Pure: what a bucket layout leaves exposed when buckets go over the link one after
another as backward releases them (:func:`modelled_exposed_s`), the result of a run
with the model beside each measurement (:class:`OverlapResult`), its table, plot and
"what we saw" sentences.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from labkit.collectives import ring_bytes_per_rank
from labkit.gradsync_links import LinkMode
from labkit.profiles import require_at_least
from labkit.topology import gbit_to_bytes_per_s

OVERLAP_RATE_GBIT = 1.0
"""The link rate of the experiment: one all-reduce of the gradient costs about one backward pass of compute."""

SMALL_BUCKET_BYTES = 1 << 20
"""Small buckets: 1 MiB, about one layer of the ci model per bucket."""

ONE_BUCKET_BYTES = 1 << 30
"""A cap larger than any model here: DDP puts every gradient in one bucket, all-reduced when backward ends."""

NO_COMMUNICATION = "no communication"
"""The same ranks and steps with ``no_sync``: the compute every variant's step is measured against."""
VARIANTS = ("one bucket", "DDP default", "small buckets")
"""Bucket layouts compared, baseline first. DDP's default is ``bucket_cap_mb=None`` (25 MiB, first bucket 1 MiB)."""

MODEL_BAND = (0.9, 1.4)
"""Measured / modelled wait allowed for one bucket and for DDP's default, where nothing can hide the last send.

Nothing crosses a shaped link faster than its rate, and the shaper charges every
packet's headers (about 4.6% over the payload), so the ratio sits just above 1;
gloo's CPU work per all-reduce adds a few ms more as the machine gets busier. Five
runs alone on the 2-core box gave 1.09-1.11 (one bucket and default alike); beside
two other sessions' experiments (load 4-5), 1.12-1.24. Measured from one rank's own
last gradient, the wait once came out 1.83x in ten runs alone: that rank had
finished backward early and waited for the other's, a straggler, not the link,
which is why the wait starts at the last gradient on any rank
(:func:`labkit.ddp_overlap.fastest_of_steps`). An unshaped link gives far below 0.9.
"""

EXPOSED_SHARE_LIMIT = 0.7
"""Small buckets must leave at most this share of the one-bucket run's exposed communication."""


@dataclasses.dataclass(frozen=True)
class OverlapSizes:
    """``layers`` x ``hidden`` MLP, batches of ``batch`` samples; ``rounds`` of ``timed_steps`` per variant."""

    hidden: int
    layers: int
    batch: int
    timed_steps: int
    rounds: int
    rate_gbit: float = OVERLAP_RATE_GBIT

    def __post_init__(self) -> None:
        require_at_least(self, 1, "hidden", "layers", "batch", "timed_steps", "rounds")
        if self.rate_gbit <= 0:
            raise ValueError(f"OverlapSizes.rate_gbit must be > 0 Gbit/s, got {self.rate_gbit}")


def modelled_exposed_s(bucket_bytes: Sequence[int], backward_s: float, link_bytes_per_s: float,
                       world_size: int = 2) -> float:
    """Communication still on the link when backward ends: buckets sent one after another, each once it is ready.

    ``bucket_bytes`` in the order DDP all-reduces them (last layer first). Backward is
    taken to produce gradient bytes at an even pace over ``backward_s`` (true for
    equal layers), so a bucket is ready when backward has produced every byte up to
    its end; the link takes each bucket's ring bytes (:func:`ring_bytes_per_rank`) at
    ``link_bytes_per_s`` and sends one bucket at a time. One bucket: its whole send is
    exposed. Many small ones: only what the link could not finish while backward ran.
    The model leaves out gloo's CPU work and the cores the ranks share, which only add.
    """
    if not bucket_bytes or min(bucket_bytes) <= 0:
        raise ValueError(f"bucket_bytes must be one or more sizes > 0, got {list(bucket_bytes)}")
    if backward_s < 0 or link_bytes_per_s <= 0 or world_size < 2:
        raise ValueError(f"backward_s must be >= 0, link_bytes_per_s > 0 and world_size >= 2, got "
                         f"{backward_s}, {link_bytes_per_s}, {world_size}")
    total, produced, link_free_s = sum(bucket_bytes), 0, 0.0
    for size in bucket_bytes:
        produced += size
        ready_s = backward_s * produced / total
        link_free_s = max(link_free_s, ready_s) + ring_bytes_per_rank("all_reduce", size, world_size) / link_bytes_per_s
    return max(link_free_s - backward_s, 0.0)


@dataclasses.dataclass(frozen=True)
class OverlapResult:
    """Step times of two ranks with each bucket layout and with no communication, the buckets, the timelines."""

    link_mode: LinkMode
    sizes: OverlapSizes
    world_size: int
    timed: dict[str, dict[str, float]]
    """Per variant and :data:`NO_COMMUNICATION`: the slowest rank's fastest ``step_s``, ``backward_s`` (until the
    last gradient) and ``tail_s`` (from the last gradient until ``backward()`` returned)."""
    bucket_bytes: dict[str, list[int]]
    timelines: dict[str, dict[str, list[tuple[float, float]]]]
    """Rank 0's profiled step per variant: ``"backward"`` op and ``"all_reduce"`` spans, ms from backward's start."""
    gradient_bytes: int

    @property
    def real_links(self) -> bool:
        return self.link_mode.mode == "namespaces"

    def step_s(self, name: str) -> float:
        return self.timed[name]["step_s"]

    @property
    def backward_s(self) -> float:
        """Backward with no communication, until its last gradient: how long buckets have to hide behind."""
        return self.timed[NO_COMMUNICATION]["backward_s"]

    def exposed_s(self, variant: str) -> float:
        """Measured: how long the step waited for the link after backward's last gradient."""
        return self.timed[variant]["tail_s"]

    def exposed_share(self, variant: str) -> float:
        """The variant's exposed communication over the one-bucket run's (1: nothing hidden)."""
        return self.exposed_s(variant) / max(self.exposed_s(VARIANTS[0]), 1e-9)

    def modelled_exposed_s(self, variant: str) -> float:
        return modelled_exposed_s(self.bucket_bytes[variant], self.backward_s,
                                  gbit_to_bytes_per_s(self.sizes.rate_gbit), self.world_size)

    def modelled_link_s(self) -> float:
        """The ring model's time for one all-reduce of the whole gradient on the link: nothing hidden."""
        return modelled_exposed_s([self.gradient_bytes], 0.0, gbit_to_bytes_per_s(self.sizes.rate_gbit),
                                  self.world_size)


def print_overlap(result: OverlapResult) -> None:
    """Per bucket layout: buckets, step and backward time, the wait for the link measured and modelled."""
    print(f"no communication: {1e3 * result.step_s(NO_COMMUNICATION):.1f} ms per step, backward "
          f"{1e3 * result.backward_s:.1f} ms of it; one all-reduce of the whole gradient "
          f"({result.gradient_bytes / 2**20:.1f} MiB) on the link: {1e3 * result.modelled_link_s():.1f} ms (modelled)")
    print(f"{'buckets':>14} {'all-reduces':>11} {'step ms':>8} {'backward ms':>11} {'wait ms':>8} {'modelled':>8} "
          f"{'share':>6}")
    for variant in VARIANTS:
        print(f"{variant:>14} {len(result.bucket_bytes[variant]):>11} {1e3 * result.step_s(variant):>8.1f} "
              f"{1e3 * result.timed[variant]['backward_s']:>11.1f} {1e3 * result.exposed_s(variant):>8.1f} "
              f"{1e3 * result.modelled_exposed_s(variant):>8.1f} {result.exposed_share(variant):>6.0%}")
    print("  backward: until its last gradient; wait: from the last gradient on any rank until every all-reduce was done, the "
          "exposed communication (measured); modelled: the buckets sent one after another as backward releases "
          "them, at the ring model's time; share: the wait over one bucket's")


def overlap_plot(result: OverlapResult):
    """Left: exposed communication per bucket layout, measured beside modelled. Right: rank 0's step, op by op."""
    from labkit.plots import BASELINE, FIX, figure

    fig, (bars_ax, time_ax) = figure(2, width=11, height=4.2)
    xs = range(len(VARIANTS))
    bars_ax.bar([x - 0.2 for x in xs], [1e3 * result.exposed_s(v) for v in VARIANTS], width=0.4, color=FIX,
                label="measured: wait after the last gradient")
    bars_ax.bar([x + 0.2 for x in xs], [1e3 * result.modelled_exposed_s(v) for v in VARIANTS], width=0.4,
                color="white", edgecolor="black", hatch="//", label="modelled: buckets sent as backward releases them")
    bars_ax.set_xticks(list(xs), [f"{v}\n({len(result.bucket_bytes[v])} all-reduces)" for v in VARIANTS], fontsize=8)
    bars_ax.set_ylabel("exposed communication per step (ms)")
    bars_ax.set_title(f"What the link adds to a step, {result.sizes.rate_gbit:g} Gbit/s", fontsize=10)
    bars_ax.set_ylim(0, 1.35 * max(1e3 * max(result.exposed_s(v), result.modelled_exposed_s(v)) for v in VARIANTS))
    bars_ax.legend(fontsize=8, loc="upper right")
    for row, variant in enumerate(VARIANTS):
        spans = result.timelines[variant]
        y = 2 * (len(VARIANTS) - 1 - row)
        time_ax.broken_barh([(a, b - a) for a, b in spans["backward"]], (y + 0.9, 0.8), color=BASELINE)
        time_ax.broken_barh([(a, b - a) for a, b in spans["all_reduce"]], (y + 0.05, 0.8), color=FIX,
                            edgecolor="black", linewidth=0.5)
        if spans["backward"]:
            time_ax.plot([max(b for _, b in spans["backward"])] * 2, [y, y + 1.8], "k:", linewidth=1)
    time_ax.set_yticks([2 * (len(VARIANTS) - 1 - r) + 0.95 for r in range(len(VARIANTS))], list(VARIANTS), fontsize=8)
    time_ax.set_xlabel("ms from the start of backward (rank 0, one profiled step)")
    time_ax.set_title("grey: backward ops; blue: gloo all-reduces; dotted: backward ends", fontsize=10)
    time_ax.grid(axis="y", visible=False)
    return fig


def overlap_sentences(result: OverlapResult) -> list[str]:
    """What the run showed, in its own numbers: exposed communication per layout, measured and modelled."""
    from labkit.narrate import share, times

    one, small = VARIANTS[0], VARIANTS[-1]
    said = [f"With one bucket the all-reduce started only when backward ended, and the step waited "
            f"{1e3 * result.exposed_s(one):.0f} ms for it after the last gradient (modelled: the ring's time for the "
            f"whole gradient on this link, {1e3 * result.modelled_link_s():.0f} ms).",
            f"With {len(result.bucket_bytes[small])} small buckets, all-reduced while backward went on, the step "
            f"waited {1e3 * result.exposed_s(small):.0f} ms, {share(result.exposed_s(small), result.exposed_s(one))} "
            f"the one-bucket wait (modelled: {1e3 * result.modelled_exposed_s(small):.0f} ms).",
            f"DDP's default buckets made {len(result.bucket_bytes['DDP default'])} all-reduces of this "
            f"{result.gradient_bytes / 2**20:.0f} MiB gradient and left {1e3 * result.exposed_s('DDP default'):.0f} ms "
            f"exposed (modelled: {1e3 * result.modelled_exposed_s('DDP default'):.0f} ms).",
            f"Backward itself, until its last gradient, took {1e3 * result.timed[small]['backward_s']:.0f} ms with small "
            f"buckets against {1e3 * result.timed[one]['backward_s']:.0f} ms with one: the all-reduces' CPU work shares "
            f"the cores with it. The whole step was "
            f"{times(result.step_s(small), result.step_s(one), more='slower', less='faster')} than with one bucket."]
    return said
