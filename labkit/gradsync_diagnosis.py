"""Lab 5's pair through ``labkit diagnose``: sync every micro-batch against delayed sync, on a slow real link.

The course's diagnosis tool must name the bottleneck where the truth is known. Each rank runs a few
optimizer steps of each sync mode inside :class:`labkit.diagnose.Diagnosis` (:func:`diagnose_modes`, on
the ranks of :func:`labkit.gradsync.run_experiment`); :func:`diagnosed_modes` averages the ranks' shares and
sets the communication the profile found per step beside the ring model's time for the same all-reduces
on that link, an independent prediction: the profile reads gloo's spans, the model only bytes and a rate.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from labkit.diagnosis_report import Verdict, stacked_shares, verdict
from labkit.gradsync_model import GradSyncResult, predicted_step_s, syncs_per_step
from labkit.gradsync_links import two_node_topology

DIAGNOSED_STEPS = 3
"""Optimizer steps each mode is profiled for, after :data:`UNPROFILED_STEPS` and :data:`WARMUP_STEPS`."""
UNPROFILED_STEPS = 2
"""Steps timed without the profiler first: what the profiler itself costs (``Diagnosis.baseline_steps``)."""
WARMUP_STEPS = 1

LINK_TIME_BAND = (0.85, 1.15)
"""Communication the profile found per step, over the ring model's time for the same all-reduces: at
0.5 Gbit/s on the 2-core CI box, ten runs of Lab 5 gave 0.96-0.99 syncing every micro-batch and 0.95-1.06
with delayed sync (``python benchmarks/ten_runs.py --runs 10 5``). Against the same loop on one rank
(1 - one rank's step / the two ranks' step) the profile's share fell 6-13 points short in a prototype run:
that difference also holds the second rank's share of the two cores, which is not communication."""


def diagnose_modes(step_fns: dict[str, Callable[[int], float]], out: Path, rank: int) -> dict[str, dict[str, Any]]:
    """Rank side: each mode's steps (``step_fns[mode](i)`` runs optimizer step ``i``) under the profiler; the
    mode's shares, profiled and unprofiled step time. Every rank must call it: the modes' collectives pair up."""
    import torch.distributed as dist

    from labkit.diagnose import Diagnosis

    found = {}
    for mode, step in step_fns.items():
        dist.barrier()
        with Diagnosis(out / mode / f"rank{rank}", steps=DIAGNOSED_STEPS, warmup=WARMUP_STEPS,
                       baseline_steps=UNPROFILED_STEPS) as probe:
            for i in range(UNPROFILED_STEPS + WARMUP_STEPS + DIAGNOSED_STEPS + 1):   # the last closes the window
                step(i)
        result = probe.result
        found[mode] = {"shares": result.shares, "step_ms": result.step_ms,
                       "unprofiled_step_ms": result.unprofiled_step_ms}
    return found


@dataclass(frozen=True)
class DiagnosedMode:
    """One sync mode as the diagnosis saw it (shares averaged over ranks) and the ring model's link time."""

    mode: str
    rate_gbit: float
    shares: dict[str, float]
    step_ms: float
    overhead: float
    """Profiled step time over unprofiled, averaged over ranks: what the profiler itself cost."""
    model_link_ms: float
    """The ring model's time for this mode's all-reduces of one optimizer step on the link."""

    @property
    def verdict(self) -> Verdict:
        return verdict(self.shares)

    @property
    def link_ms(self) -> float:
        """Exposed communication the profile found per step."""
        return self.shares["communication"] * self.step_ms

    @property
    def link_over_model(self) -> float:
        return self.link_ms / self.model_link_ms


def diagnosed_modes(result: GradSyncResult) -> tuple[DiagnosedMode, ...]:
    """``result``'s diagnoses (every rank's :func:`diagnose_modes`), averaged over ranks, each beside the ring
    model (its framing measured over the whole run, as Lab 5's rows use it); empty where none ran."""
    ranks, rate_gbit = result.diagnoses, result.diagnose_rate_gbit
    if not ranks or rate_gbit is None:
        return ()
    topology = two_node_topology(result.world_size, rate_gbit)
    framing = result.wire_bytes_per_payload_byte or 1.0
    found = []
    for mode in ranks[0]:
        per_rank = [r[mode] for r in ranks]
        shares = {name: sum(r["shares"][name] for r in per_rank) / len(per_rank) for name in per_rank[0]["shares"]}
        syncs = syncs_per_step(mode, result.sizes.accumulation)
        model_s = predicted_step_s(0.0, syncs, result.gradient_bytes, topology, framing)
        found.append(DiagnosedMode(
            mode, rate_gbit, shares, step_ms=sum(r["step_ms"] for r in per_rank) / len(per_rank),
            overhead=sum(r["step_ms"] / r["unprofiled_step_ms"] for r in per_rank) / len(per_rank),
            model_link_ms=1e3 * model_s))
    return tuple(found)


def plot_modes(diagnosed: tuple[DiagnosedMode, ...]):
    """Each mode's step as the diagnosis split it, with the ring model's link time marked where the
    communication segment would end if the profile found exactly the model's time."""
    from labkit import plots
    from labkit.gradsync_model import MODE_NAMES

    fig, (ax,) = plots.figure(1, width=8, height=3.0)
    labels = [f"{MODE_NAMES[d.mode]}\n{d.step_ms:.0f} ms a step" for d in diagnosed]
    stacked_shares(ax, labels, [d.shares for d in diagnosed])
    before = [100 * sum(d.shares[c] for c in ("data", "host_to_device", "compute")) for d in diagnosed]
    ends = [b + 100 * d.model_link_ms / d.step_ms for b, d in zip(before, diagnosed)]
    ax.scatter(ends, labels, marker="|", s=900, color="black", zorder=3, label="ring model's link time (modelled)")
    ax.set_xlim(0, max(100.0, *ends) + 3)   # the model may put more on the link than the step held
    ax.legend(ncol=4, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    ax.set_title(f"measured: each step split by labkit diagnose, {diagnosed[0].rate_gbit:g} Gbit/s link")
    return fig
