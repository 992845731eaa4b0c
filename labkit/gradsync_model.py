"""Lab 5's model of a data-parallel step, and the measured rows set beside it.

One optimizer step costs one rank's compute plus, for every gradient sync, a ring
all-reduce of the whole gradient over the link (:func:`predicted_step_s`): syncing
every micro-batch pays it ``accumulation`` times, delayed sync once. The model
knows nothing of DDP's overlap or of gloo's own CPU work, so where a measurement
(:mod:`labkit.gradsync`) exceeds it, that is what the model leaves out. The ranks
send back plain dictionaries; :func:`gradsync_result` turns them, once, into a
:class:`GradSyncResult` whose rows (:class:`SyncRow`) carry the model beside each
measurement; it is pure, so tests call it without ranks.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Sequence

from labkit.collectives import ring_bytes_per_rank
from labkit.gradsync_links import LinkMode, two_node_topology
from labkit.gradsync_workload import check_accumulation
from labkit.topology import Topology, predicted_s

if TYPE_CHECKING:
    from labkit.gradsync_workload import GradSyncSizes
    from labkit.gradsync_deepspeed import DeepSpeedCounts

UNSHAPED_GBIT = 100.0
"""A rate no link here comes near: gloo moves well under 10 Gbit/s between two CPU
processes, so at this rate what remains is its own cost."""

MODES = ("sync_every_micro_step", "delayed_sync")


MODEL_BAND = (0.9, 1.2)
"""Measured / model ms per sample allowed where the link dominates: the slowest rate, syncing every micro-batch.

Nineteen runs on a shared 2-core box (load average 7-20, another fabric running)
gave 0.98-1.07 there. Below 1: DDP overlaps part of each all-reduce with the backward
pass and tbf lets 1 ms of traffic run ahead, a few % at most; nothing crosses a
shaped link faster than its rate, so 0.9 is also the floor for every shaped row
that syncs every micro-batch. Above 1: gloo's CPU work per sync (a few ms, what
the unshaped rate shows) grows with the load; 1.2 is about three times the worst
excess seen. Faster links are printed, not held to it: at 0.5 Gbit/s the same
runs gave 0.96-1.59, the CPU's share of each sync showing through.
"""


def syncs_per_step(mode: str, accumulation: int) -> int:
    """Gradient all-reduces per optimizer step the lesson predicts: one per micro-batch, or one per window."""
    check_accumulation(accumulation)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return accumulation if mode == "sync_every_micro_step" else 1


def predicted_step_s(
    compute_step_s: float,
    syncs: int,
    gradient_bytes: int,
    topology: Topology,
    wire_bytes_per_payload_byte: float = 1.0,
) -> float:
    """One optimizer step by the model: one rank's measured compute, plus each sync's ring all-reduce on the link.

    No overlap of communication with backward and no cost for gloo itself: what
    the measurement exceeds this by is what the model leaves out.
    """
    if compute_step_s < 0 or syncs < 0:
        raise ValueError(f"compute_step_s and syncs must be >= 0, got {compute_step_s}, {syncs}")
    return compute_step_s + syncs * predicted_s("all_reduce", gradient_bytes, topology, wire_bytes_per_payload_byte)


def ms_per_sample(step_s: float, world_size: int, accumulation: int, micro_batch: int) -> float:
    """Milliseconds per training sample: a step processes world_size x accumulation x micro_batch samples."""
    if world_size < 1 or micro_batch < 1:
        raise ValueError(f"world_size and micro_batch must be >= 1, got {world_size}, {micro_batch}")
    check_accumulation(accumulation)
    return 1e3 * step_s / (world_size * accumulation * micro_batch)


def framing(wire_bytes: int, payload_bytes: int) -> float | None:
    """Wire bytes per payload byte; ``None`` when no shaper counted anything (the link is not shaped)."""
    if payload_bytes <= 0:
        raise ValueError(f"payload_bytes must be > 0, got {payload_bytes}")
    return wire_bytes / payload_bytes if wire_bytes > 0 else None


@dataclasses.dataclass(frozen=True)
class SingleDevice:
    """One rank training alone, no communication: the step time data parallelism is measured against."""

    step_s: float
    ms_per_sample: float


@dataclasses.dataclass(frozen=True)
class SyncRow:
    """One sync mode at one link rate: what the ranks measured per optimizer step, and the model beside it.

    Times are the slowest rank's; calls and counted bytes are rank 0's (every
    rank issues the same collectives); bytes the kernel counted leaving each node
    are kept per rank, because each node has its own uplink.
    """

    rate_gbit: float
    mode: str
    accumulation: int
    step_s: float
    ms_per_sample: float
    all_reduce_calls_per_step: float
    all_reduce_bytes_per_step: float
    ring_bytes_per_step: float
    tx_bytes_per_step_by_rank: tuple[float, ...]
    wire_bytes_per_step_by_rank: tuple[float, ...]
    emulated_s_per_step: float
    final_loss: float
    model_ms_per_sample: float
    model_link_share: float
    model_ring_bytes_per_step: int

    @property
    def tx_bytes_per_step(self) -> float:
        """TCP payload rank 0's node sent per step (0 where no fabric counts it)."""
        return self.tx_bytes_per_step_by_rank[0]

    @property
    def wire_bytes_per_step(self) -> float:
        """Bytes rank 0's shaper charged per step, headers included (0 where nothing is shaped)."""
        return self.wire_bytes_per_step_by_rank[0]

    @property
    def measured_over_model(self) -> float:
        return self.ms_per_sample / self.model_ms_per_sample


@dataclasses.dataclass(frozen=True)
class GradSyncResult:
    """One Lab 5 run: every (rate, mode) row, one rank alone, DeepSpeed's counts, and which links ran.

    ``wire_bytes_per_payload_byte`` (the framing) is measured over the whole run,
    what the shapers sent against the ring bytes the counter saw; without shapers
    it is ``None`` and the model uses 1.0.
    """

    world_size: int
    sizes: GradSyncSizes
    link_mode: LinkMode
    single_device: SingleDevice
    gradient_bytes: int
    same_update_max_diff: float
    wire_bytes_per_payload_byte: float | None
    rows: tuple[SyncRow, ...]
    deepspeed: tuple[DeepSpeedCounts, ...] = ()
    wall_s: float = 0.0
    diagnoses: tuple[dict[str, dict[str, Any]], ...] = ()
    """Each rank's ``labkit.diagnose`` shares per sync mode (:mod:`labkit.gradsync_diagnosis`), if asked for."""
    diagnose_rate_gbit: float | None = None

    @property
    def mode_label(self) -> str:
        return self.link_mode.label

    @property
    def real_links(self) -> bool:
        """True when gloo's bytes crossed a fabric's links, so times are evidence; False under the sleep emulation."""
        return self.link_mode.mode == "namespaces"

    def row(self, rate_gbit: float, mode: str) -> SyncRow:
        """The one row measured at ``rate_gbit`` in sync ``mode``."""
        found = [row for row in self.rows if row.rate_gbit == rate_gbit and row.mode == mode]
        if len(found) != 1:
            raise KeyError(f"expected one row at {rate_gbit:g} Gbit/s in mode {mode!r}, found {len(found)}; "
                           f"rates measured: {sorted({row.rate_gbit for row in self.rows})}")
        return found[0]

    def sent_over_model(self) -> float:
        """TCP payload the nodes' interfaces sent over the whole run / what the ring model says they carried.

        Headers are subtracted (:class:`labkit.fabric.LinkBytes`), so what is left
        above 1 is gloo's own small messages, and resends if a shaper ever dropped.
        """
        sent = sum(sum(row.tx_bytes_per_step_by_rank) for row in self.rows)
        return sent / sum(self.world_size * row.model_ring_bytes_per_step for row in self.rows)


def gradsync_result(ranks: Sequence[dict[str, Any]], sizes: GradSyncSizes, link_mode: LinkMode) -> GradSyncResult:
    """Every rank's measurements (the dicts :func:`labkit.gradsync.train_rank` returns), as one result with the model.

    Rank 0's rows, each with every rank's kernel byte counts and what the model
    predicts beside it. Pure: tests build ``ranks`` by hand.
    """
    first, n = ranks[0], len(ranks)
    per_node = ("tx_bytes_per_step", "wire_bytes_per_step")
    measured = [{**{key: value for key, value in row.items() if key not in per_node},
                 **{f"{key}_by_rank": tuple(r["rows"][i][key] for r in ranks) for key in per_node}}
                for i, row in enumerate(first["rows"])]
    wire = sum(sum(row["wire_bytes_per_step_by_rank"]) for row in measured)
    payload = sum(n * row["ring_bytes_per_step"] for row in measured)
    framed = framing(int(wire), int(payload)) if payload else None
    single = SingleDevice(**first["single_device"])
    rows = tuple(_predicted_row(row, single.step_s, first["gradient_bytes"], n, sizes.micro_batch, framed or 1.0)
                 for row in measured)
    return GradSyncResult(
        world_size=n, sizes=sizes, link_mode=link_mode, single_device=single, gradient_bytes=first["gradient_bytes"],
        same_update_max_diff=first["same_update_max_diff"], wire_bytes_per_payload_byte=framed, rows=rows,
        deepspeed=tuple(first.get("deepspeed", ())), wall_s=first.get("wall_s", 0.0))


def _predicted_row(measured: dict[str, Any], compute_s: float, gradient_bytes: int, world_size: int,
                   micro_batch: int, wire_bytes_per_payload_byte: float) -> SyncRow:
    """One measured row and, beside it, what the model predicts: ms per sample, the link's share, ring bytes."""
    syncs = syncs_per_step(measured["mode"], measured["accumulation"])
    topology = two_node_topology(world_size, measured["rate_gbit"])
    model_s = predicted_step_s(compute_s, syncs, gradient_bytes, topology, wire_bytes_per_payload_byte)
    return SyncRow(
        **measured,
        model_ms_per_sample=ms_per_sample(model_s, world_size, measured["accumulation"], micro_batch),
        model_link_share=1 - compute_s / model_s,
        model_ring_bytes_per_step=predicted_ring_bytes_per_step(gradient_bytes, world_size, syncs),
    )


def predicted_ring_bytes_per_step(gradient_bytes: int, world_size: int, syncs_per_step: int) -> int:
    """What the ring model says one optimizer step's gradient all-reduces send per rank."""
    return syncs_per_step * ring_bytes_per_rank("all_reduce", gradient_bytes, world_size)


def rate_label(rate_gbit: float) -> str:
    return f"{rate_gbit:g} Gbit/s" + (" (~unshaped)" if rate_gbit >= UNSHAPED_GBIT else "")


MODE_NAMES = {"sync_every_micro_step": "sync every micro-batch", "delayed_sync": "delayed sync"}

TABLE_COLUMNS = (
    ("rate", "the link's rate each way, Gbit/s"),
    ("mode", "when the ranks all-reduce their gradients: after every micro-batch, or once per window"),
    ("syncs", "gradient syncs per optimizer step (DDP sends each as one all-reduce per gradient bucket)"),
    ("ms/sample", "measured: the slowest rank's optimizer step / the samples all ranks trained on in it"),
    ("model", "the same by the model: one rank's measured compute + syncs x the ring all-reduce at the rate"),
    ("meas/model", "measured / model: above 1, time the model leaves out (gloo's own work, the busy cores)"),
)
"""The columns of :func:`print_table`, each with what it means: printed under the table."""


def print_table(result: GradSyncResult) -> None:
    """The learner's table: per rate and mode, measured ms per sample beside the model's; every column defined."""
    print(f"links: {result.mode_label}")
    print(f"one rank alone, no communication: {result.single_device.ms_per_sample:.3f} ms/sample (measured)")
    print(f"{'rate':>22} {'mode':>23} {'syncs':>5} {'ms/sample':>10} {'model':>9} {'meas/model':>10}")
    for row in result.rows:
        print(f"{rate_label(row.rate_gbit):>22} {MODE_NAMES[row.mode]:>23} {syncs_per_step(row.mode, row.accumulation):>5d} "
              f"{row.ms_per_sample:>10.3f} {row.model_ms_per_sample:>9.3f} {row.measured_over_model:>10.2f}")
    for name, meaning in TABLE_COLUMNS:
        print(f"  {name}: {meaning}")


def print_bytes_table(result: GradSyncResult) -> None:
    """The byte detail, per optimizer step, in MB: what the ranks counted, what the kernel saw, and the ring model.

    ``counted`` is the ring bytes the collective counter attributes to rank 0;
    ``sent`` the TCP payload rank 0's node put on its uplink (headers taken off);
    ``wire`` what its shaper charged, headers included; ``model`` the ring model.
    """
    framed = result.wire_bytes_per_payload_byte
    print(f"framing (wire bytes per payload byte, whole run): {f'{framed:.4f}' if framed else 'not measured (no shaper)'}")
    print(f"{'rate':>22} {'mode':>23} {'counted MB':>10} {'sent MB':>8} {'wire MB':>8} {'model MB':>8}")
    for row in result.rows:
        print(f"{rate_label(row.rate_gbit):>22} {MODE_NAMES[row.mode]:>23} {row.ring_bytes_per_step / 1e6:>10.3f} "
              f"{row.tx_bytes_per_step / 1e6:>8.3f} {row.wire_bytes_per_step / 1e6:>8.3f} "
              f"{row.model_ring_bytes_per_step / 1e6:>8.3f}")
    print("  per optimizer step, rank 0's node; counted: by the ranks' collective counter; sent: TCP payload on the "
          "uplink (kernel); wire: what the shaper charged, headers included; model: ring all-reduce bytes")


def scaling_plot(result: GradSyncResult):
    """Milliseconds per sample per link rate: bars are measured, black markers are the model."""
    from labkit.plots import BASELINE, FIX, WARN, figure

    rates = list(dict.fromkeys(row.rate_gbit for row in result.rows))
    fig, (ax,) = figure(1, width=9, height=4.2)
    width = 0.27
    xs = list(range(len(rates)))
    ax.bar([x - width for x in xs], [result.single_device.ms_per_sample] * len(rates), width,
           color=BASELINE, label="1 rank alone (measured)")
    for offset, mode, color, name in ((0.0, "sync_every_micro_step", WARN, "sync every micro-batch"),
                                      (width, "delayed_sync", FIX, "delayed sync")):
        picked = [result.row(rate, mode) for rate in rates]
        at = [x + offset for x in xs]
        ax.bar(at, [r.ms_per_sample for r in picked], width, color=color,
               label=f"{result.world_size} ranks, {name} (measured)")
        ax.plot(at, [r.model_ms_per_sample for r in picked], "kD", markersize=6, linestyle="none",
                label="model" if mode == MODES[0] else None)
    ax.set_xticks(xs, [rate_label(rate) for rate in rates])
    ax.set_yscale("log")
    ax.set_ylabel("ms per sample (lower is better)")
    ax.set_title(f"Data parallelism over {result.mode_label}", fontsize=10)
    ax.legend(fontsize=8)
    return fig


def _than(comparison: str) -> str:
    return f"{comparison} {'as' if comparison == 'about the same' else 'than'}"


def model_sentences(result: GradSyncResult) -> list[str]:
    """What the run showed of the model, from its own rows: how far each shaped sync-every row sat from it."""
    from labkit.narrate import times

    shaped = [r for r in result.rows if r.rate_gbit < UNSHAPED_GBIT and r.mode == "sync_every_micro_step"]
    first, *rest = shaped
    said = [f"syncing every micro-batch at {first.rate_gbit:g} Gbit/s took {first.ms_per_sample:.1f} ms per sample "
            f"against the model's {first.model_ms_per_sample:.1f}, {_than(times(first.ms_per_sample, first.model_ms_per_sample, more='slower', less='faster'))} the model."]
    if rest:
        said.append("On the faster shaped links the measurement was " + ", ".join(
            f"{r.measured_over_model:.2f}x the model at {r.rate_gbit:g} Gbit/s" for r in rest) + ".")
    return said


def ordering_sentences(result: GradSyncResult, rates_gbit: Sequence[float]) -> list[str]:
    """Per rate, delayed sync against syncing every micro-batch, then two ranks against one rank alone, in words."""
    from labkit.narrate import times

    alone = result.single_device.ms_per_sample
    said = []
    for rate in rates_gbit:
        every, delayed = result.row(rate, "sync_every_micro_step"), result.row(rate, "delayed_sync")
        said.append(f"At {rate_label(rate)} delayed sync was {_than(times(every.ms_per_sample, delayed.ms_per_sample))} "
                    f"syncing every micro-batch ({delayed.ms_per_sample:.2f} against {every.ms_per_sample:.2f} ms per sample).")
    slowest = result.row(min(rates_gbit), "sync_every_micro_step")
    best = min((r for r in result.rows if r.mode == "delayed_sync"), key=lambda r: r.ms_per_sample)
    said.append(f"Two ranks syncing every micro-batch at {slowest.rate_gbit:g} Gbit/s were "
                f"{_than(times(alone, slowest.ms_per_sample))} one rank alone ({alone:.3f} ms per sample); "
                f"delayed sync's best, at {rate_label(best.rate_gbit)}, was {_than(times(alone, best.ms_per_sample))} "
                "one rank alone.")
    return said


def sync_cost_sentences(result: GradSyncResult) -> list[str]:
    """Each sync's cost beyond compute, unshaped (gloo and the CPU) and at the slowest rate, against a micro-batch."""
    from labkit.narrate import times

    per_micro_batch_ms = 1e3 * result.single_device.step_s / result.sizes.accumulation
    unshaped = result.row(max(r.rate_gbit for r in result.rows), "sync_every_micro_step")
    slowest = result.row(min(r.rate_gbit for r in result.rows), "sync_every_micro_step")
    not_link_ms, slow_ms = (sync_beyond_compute_ms(result, row) for row in (unshaped, slowest))
    more = dict(more="longer", less="shorter")
    return [f"One rank computes a micro-batch in {per_micro_batch_ms:.1f} ms.",
            f"Unshaped, each sync cost {not_link_ms:.1f} ms beyond compute (gloo and the CPU, not the link), "
            f"{_than(times(not_link_ms, per_micro_batch_ms, **more))} a micro-batch of compute;"
            f" at {slowest.rate_gbit:g} Gbit/s each sync cost {slow_ms:.1f} ms, "
            f"{_than(times(slow_ms, per_micro_batch_ms, **more))} a micro-batch."]


def sync_beyond_compute_ms(result: GradSyncResult, row: SyncRow) -> float:
    """What one sync of ``row`` cost beyond one rank's compute: (step - compute) / syncs per step, in ms."""
    return 1e3 * (row.step_s - result.single_device.step_s) / syncs_per_step(row.mode, row.accumulation)


def model_sync_ms(result: GradSyncResult, row: SyncRow) -> float:
    """What the ring model gives one sync of ``row`` on its link, headers included, in ms: the time
    :func:`sync_beyond_compute_ms` measures, less gloo's own work, which the model leaves out."""
    topology = two_node_topology(result.world_size, row.rate_gbit)
    return 1e3 * predicted_s("all_reduce", result.gradient_bytes, topology, result.wire_bytes_per_payload_byte or 1.0)


def bytes_sentences(result: GradSyncResult) -> list[str]:
    """What the nodes sent over the run against the ring model, and what the headers added on the wire."""
    framed = result.wire_bytes_per_payload_byte
    if framed is None:
        return ["No shaper counted the wire here: only the counter's bytes were checked."]
    sent = result.sent_over_model()
    return [f"Over the run the nodes sent {sent:.4f}x the ring model's bytes ({100 * (sent - 1):.2f}% more: gloo's own "
            f"messages, TCP's resends), and the wire carried {100 * (framed - 1):.1f}% more than the payload for headers."]
