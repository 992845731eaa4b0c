"""Lab 7's experiments: real training loops that checkpoint every k steps, and what the saves cost them.

:func:`train_with_checkpoints` trains the same model with each saver and records
how long every save blocked the loop; :func:`resume_experiment` kills nothing but
restarts from a checkpoint and checks the run continues bit-identically;
:func:`compare_savers_rank` runs on real ranks, each saving its own shard, as
torch.distributed.checkpoint does.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from labkit import checkpoint, savers
from labkit.devices import PeakRss, return_freed_heap, time_ms
from labkit.models import mlp, parameter_count
from labkit.profiles import require_at_least


PROFILE_LOOP_AGREEMENT = 0.10
"""How far, in share of the step, ``labkit.diagnose``'s checkpoint share may sit from the share of the same
steps the loop timed in save calls: the issue's 10 points. The tool wraps the course's savers whole, so
both clocks time the same calls; before it did (``torch.save`` and ``fsync`` only), a synchronous run's
profile found 0.82-0.86 of the loop's share, 11-23 points short, and an async save's wait for the previous
write not at all."""
SAVES_DOMINATE = 0.6
"""The share of the steps a synchronous run spent in save calls, by its own clock, above which a diagnosis
must name the checkpoint: the rest of a step is compute, one category. The diagnosed job saves every step;
in 10 runs of Lab 7 here its saves took 51-83% of the steps, as the disk absorbed the writes faster or
slower, and at 51% the profile found checkpoint 44%, compute 48% (at 61-62%: checkpoint 53-55%)."""


@dataclass(frozen=True)
class StallSizes:
    """A training state of ``state_mb`` MB trained ``steps`` steps and saved every ``save_every``; on real
    ranks, ``dcp_state_mb_per_rank`` MB per rank saved ``dcp_saves`` times (the first is set-up, so >= 2)."""

    state_mb: float
    steps: int
    save_every: int
    dcp_state_mb_per_rank: float
    dcp_saves: int

    def __post_init__(self) -> None:
        require_at_least(self, 1, "state_mb", "steps", "save_every", "dcp_state_mb_per_rank")
        require_at_least(self, 2, "dcp_saves")


SIZES = {
    "ci": StallSizes(state_mb=64, steps=12, save_every=4, dcp_state_mb_per_rank=48, dcp_saves=3),
    "gpu": StallSizes(state_mb=512, steps=60, save_every=10, dcp_state_mb_per_rank=256, dcp_saves=4),
    "multi-gpu": StallSizes(state_mb=1024, steps=60, save_every=10, dcp_state_mb_per_rank=512, dcp_saves=4),
}
_WIDTH = 1024
_BYTES_PER_PARAM_WITH_ADAM = 12


def make_model(state_mb: float, *, device: str | torch.device = "cpu", seed: int = 0):
    """An MLP plus Adam whose checkpoint (weights + two moments, fp32) is about
    at least ``state_mb`` MB: the size, not the architecture, is what a save pays for."""
    if state_mb <= 0:
        raise ValueError(f"state_mb must be > 0, got {state_mb}")
    layers = max(1, math.ceil(state_mb * 1e6 / _BYTES_PER_PARAM_WITH_ADAM / parameter_count([_WIDTH, _WIDTH])))
    # Dropout draws from the RNG every step: a resume that did not restore the RNG state shows.
    model = torch.nn.Sequential(mlp([_WIDTH] * (layers + 1), activation=torch.nn.GELU, seed=seed),
                                torch.nn.Dropout(0.1)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    return model, optimizer


def train_step(model, optimizer, position: int, device, batch: int = 32) -> float:
    gen = torch.Generator().manual_seed(position)
    x = torch.randn(batch, _WIDTH, generator=gen).to(device)
    target = torch.randn(batch, _WIDTH, generator=gen).to(device)
    loss = torch.nn.functional.mse_loss(model(x), target)
    optimizer.zero_grad(set_to_none=False)
    loss.backward()
    optimizer.step()
    return loss.item()


HIDE_MARGIN = 2.0
"""How many write-times of training :func:`plan_sizes` puts between saves. A write that
runs beside training is slower than one alone (on an H200 machine an async write took
1.6x the sync one), and a save that finds the previous write unfinished waits for it."""


@dataclass(frozen=True)
class SavePlan:
    """What :func:`plan_sizes` measured, and the sizes it chose from it."""

    step_s: float
    write_s: float
    sizes: StallSizes

    def describe(self) -> str:
        interval = self.sizes.save_every * self.step_s
        return (f"measured: a training step {self.step_s * 1e3:.1f} ms, one synchronous save {self.write_s * 1e3:.0f} ms; "
                f"saving every {self.sizes.save_every} steps leaves {interval * 1e3:.0f} ms of training between saves "
                f"({interval / self.write_s:.1f}x the write), {self.sizes.steps // self.sizes.save_every} saves per run")


def plan_sizes(sizes: StallSizes, directory: str | Path, *, device: str | torch.device = "cpu",
               steps: int = 9) -> SavePlan:
    """``sizes`` with ``save_every`` raised until a write fits :data:`HIDE_MARGIN` times between saves.

    An async save hides its write only if training runs long enough between saves for
    the write to finish; otherwise the next save waits for it, and "async" blocks
    about as long as "sync". How long that is depends on this machine: a GPU step on
    Lab 7's model takes about 10 ms, a CPU step far longer, a disk writes at 0.5 GB/s
    or at 5. So time ``steps`` training steps and one synchronous save of this state
    here, and derive the interval from them. The number of saves per run stays the
    profile's; ``save_every`` never drops below the profile's.

    The step is the median of ``steps`` after two warm-up steps: a fresh process's first steps on a
    fresh model fault in new memory, and on a 2-core box they alternated 29 and 43 ms for a dozen steps
    before settling at 24-31 ms. With one warm-up and five steps the plan once measured 41.7 ms, against
    27-30 ms in the runs it sized, and so saved more often than :data:`HIDE_MARGIN` intends. With two and
    nine, in ten runs of Lab 7, it measured 0.64-1.08x the median step of the run without checkpoints
    that followed (itself 26-43 ms from run to run): when it errs, it errs towards more steps between saves.
    """
    device = torch.device(device)
    model, optimizer = make_model(sizes.state_mb, device=device)
    positions = itertools.count()
    step_s = statistics.median(time_ms(lambda: train_step(model, optimizer, next(positions), device),
                                       device=device, warmup=2, repeats=steps)) / 1e3
    with savers.SyncSaver(directory, keep=1) as saver:
        write_s = saver.save(1, checkpoint.capture_training_state(model, optimizer, loader_position=1)).total_s
    return SavePlan(step_s=step_s, write_s=write_s, sizes=sizes_for(sizes, step_s=step_s, write_s=write_s))


def sizes_for(sizes: StallSizes, *, step_s: float, write_s: float) -> StallSizes:
    """The pure half of :func:`plan_sizes`: ``save_every`` such that HIDE_MARGIN writes fit between saves."""
    if step_s <= 0 or write_s < 0:
        raise ValueError(f"step_s must be > 0 and write_s >= 0, got {step_s} and {write_s}")
    save_every = max(sizes.save_every, math.ceil(HIDE_MARGIN * write_s / step_s))
    saves = sizes.steps // sizes.save_every
    return dataclasses.replace(sizes, steps=saves * save_every, save_every=save_every)


@dataclass(frozen=True)
class TrainingRun:
    """One checkpointed training run. Times are seconds; ``*_spans`` are
    (start, duration) pairs relative to the run's start, for timelines.
    ``wall_s`` ends with the last step; ``drain_s`` is the wait for the last
    async write to commit after it (a cost paid once per run, not per save)."""

    kind: str
    steps: int
    save_every: int
    state_bytes: int
    wall_s: float
    drain_s: float
    compute_s: float
    saves: list[checkpoint.SaveStats]
    step_spans: list[tuple[float, float]]
    blocked_spans: list[tuple[float, float]]
    write_spans: list[tuple[float, float]]
    peak_rss_added_bytes: int
    losses: list[float]
    origin_s: float = 0.0
    """``time.perf_counter()`` when the first step started; every span is in seconds after it."""

    @property
    def end_s(self) -> float:
        """Seconds from the first step to the last byte committed: the final write included."""
        return self.wall_s + self.drain_s

    @property
    def median_step_s(self) -> float:
        durations = sorted(d for _, d in self.step_spans)
        return durations[len(durations) // 2]

    @property
    def fastest_step_s(self) -> float:
        """The shortest step: what a step costs with nothing else slowing it (noise only adds time)."""
        return min(d for _, d in self.step_spans)

    def goodput(self, baseline: "TrainingRun") -> float:
        """:func:`labkit.interval.goodput` of this run against ``baseline``, the same steps without checkpoints.

        Useful time is this run's steps at the baseline's fastest step: what the
        training work costs with nothing saved and nothing else in the way. A run's
        *own* step time will not do: a background writer that slows every step
        raises it with the wall time, so a run that finished later could score
        higher. The baseline's fastest step rather than its median, because the
        three runs follow each other and other work on a shared machine lengthens
        the steps of one run more than another's: it only ever adds time.
        """
        from labkit.interval import goodput

        if baseline.kind != "none":
            raise ValueError(f"the baseline must be the run without checkpoints (kind 'none'), got {baseline.kind!r}")
        return goodput(self.steps * baseline.fastest_step_s, self.end_s)

    def blocked_share(self, window: tuple[float, float] | None = None) -> float:
        """Share of the wall time training stood in save calls, as the loop timed it; within ``window``
        (two ``time.perf_counter()`` readings, e.g. the steps a profiler recorded) if given."""
        start, end = window if window is not None else (self.origin_s, self.origin_s + self.wall_s)
        inside = [seconds for called, seconds in self.blocked_spans if start <= self.origin_s + called < end]
        return sum(inside) / (end - start)

    @property
    def mean_blocked_s(self) -> float:
        """Mean seconds training stood still per save, timed around the save call by the loop."""
        return sum(d for _, d in self.blocked_spans) / max(1, len(self.blocked_spans))

    @property
    def mean_write_s(self) -> float:
        """Mean seconds a background write took after ``save`` returned (0 for a sync run).

        An async save that blocks for less than half of this has moved the write
        off the training loop; one that waits for its write blocks longer than it.
        """
        return sum(d for _, d in self.write_spans) / max(1, len(self.write_spans))

    @property
    def mean_total_s(self) -> float:
        return sum(s.total_s for s in self.saves) / max(1, len(self.saves))

    def describe(self, baseline: "TrainingRun") -> str:
        """One line per run; the lab and its benchmark both print this one, so their figures compare."""
        return (f"{self.kind:>5}: blocked {self.mean_blocked_s * 1e3:7.1f} ms/save, "
                f"total {self.mean_total_s * 1e3:7.1f} ms/save, median step {self.median_step_s * 1e3:6.1f} ms, "
                f"ended at {self.end_s:.2f} s (final write included), goodput {self.goodput(baseline):.3f} "
                f"(useful: {self.steps} steps x {baseline.fastest_step_s * 1e3:.1f} ms, the fastest without checkpoints), "
                f"peak host memory added {self.peak_rss_added_bytes / 1e6:.0f} MB")


def train_with_checkpoints(
    kind: str,
    directory: str | Path,
    *,
    state_mb: float,
    steps: int,
    save_every: int,
    device: str | torch.device = "cpu",
    keep: int = 2,
    progress: bool = False,
) -> TrainingRun:
    """Train ``steps`` steps, saving every ``save_every`` with ``kind`` in
    ``("none", "sync", "async")``, and record what each save cost training."""
    if kind not in ("none", *savers.SAVERS):
        raise ValueError(f"kind must be 'none', 'sync' or 'async', got {kind!r}")
    if steps < 1 or save_every < 1:
        raise ValueError(f"steps and save_every must be >= 1, got {steps}, {save_every}")
    from labkit.devices import synchronize

    device = torch.device(device)
    model, optimizer = make_model(state_mb, device=device)
    train_step(model, optimizer, 0, device)
    saver = savers.SAVERS[kind](directory, keep=keep) if kind != "none" else None
    step_spans, blocked_spans, losses, saves = [], [], [], []
    iterator = range(1, steps + 1)
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(iterator, desc=f"{kind} checkpoints", leave=False)
    return_freed_heap()   # an earlier run's freed buffers, still resident, would hold the snapshot unseen
    with PeakRss() as rss:
        origin = time.perf_counter()
        for step in iterator:
            start = time.perf_counter()
            losses.append(train_step(model, optimizer, step, device))
            synchronize(device)
            step_spans.append((start - origin, time.perf_counter() - start))
            if saver is not None and step % save_every == 0:
                # blocked time as training saw it: the call, including any wait for the previous save
                called = time.perf_counter()
                saver.save(step, checkpoint.capture_training_state(model, optimizer, loader_position=step))
                blocked_spans.append((called - origin, time.perf_counter() - called))
        wall_s = time.perf_counter() - origin
        drain_start = time.perf_counter()
        if saver is not None:
            saver.close()
            saves = list(saver.history)
        drain_s = time.perf_counter() - drain_start
    write_spans = [
        (s.started_s + s.blocked_s - origin, s.committed_s - s.started_s - s.blocked_s) for s in saves
    ]
    if kind == "sync":
        write_spans = []
    return TrainingRun(
        kind=kind, steps=steps, save_every=save_every,
        state_bytes=savers.state_bytes(checkpoint.capture_training_state(model, optimizer, loader_position=0)),
        wall_s=wall_s, drain_s=drain_s, compute_s=sum(d for _, d in step_spans), saves=saves,
        step_spans=step_spans, blocked_spans=blocked_spans, write_spans=write_spans,
        peak_rss_added_bytes=rss.added_bytes, losses=losses, origin_s=origin,
    )


def resume_experiment(
    directory: str | Path, *, kind: str = "async", state_mb: float = 8, steps: int = 8, save_at: int = 4,
    device: str | torch.device = "cpu",
) -> tuple[list[float], list[float]]:
    """Losses after step ``save_at`` of an uninterrupted run, and of a run rebuilt
    from scratch (different init, disturbed RNGs) and resumed from the checkpoint.

    On ``device="cuda"`` the model's dropout draws from the CUDA generator, so the
    losses match only if the checkpoint restored that generator's state too.
    """
    if not 1 <= save_at < steps:
        raise ValueError(f"save_at must be in [1, steps), got {save_at} with steps={steps}")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} needs a CUDA GPU and this machine has none; use device='cpu'")
    model, optimizer = make_model(state_mb, device=device, seed=0)
    with savers.SAVERS[kind](directory, keep=2) as saver:
        for step in range(1, save_at + 1):
            train_step(model, optimizer, step, device)
        saver.save(save_at, checkpoint.capture_training_state(model, optimizer, loader_position=save_at))
    uninterrupted = [train_step(model, optimizer, step, device) for step in range(save_at + 1, steps + 1)]

    model, optimizer = make_model(state_mb, device=device, seed=1)
    random.random(), np.random.rand(), torch.rand(3), torch.rand(3, device=device)
    position = checkpoint.restore_training_state(checkpoint.load_latest(directory).state, model, optimizer)
    resumed = [train_step(model, optimizer, step, device) for step in range(position + 1, steps + 1)]
    return uninterrupted, resumed


def timeline_spans(run: TrainingRun) -> list[tuple[str, float, float, str]]:
    """Rows for ``labkit.plots.timeline`` (milliseconds): steps, blocked time, background writes,
    and the wait for the final write after the last step, so the timeline ends where the run does."""
    from labkit.plots import BASELINE, FIX, PALETTE, WARN

    spans = [("training step", s * 1e3, d * 1e3, FIX) for s, d in run.step_spans]
    spans += [("training blocked by save", s * 1e3, d * 1e3, WARN) for s, d in run.blocked_spans]
    if run.drain_s > 0:   # after the last step: no training is left to block, the run waits for the commit
        spans.append(("waiting for the last write to commit", run.wall_s * 1e3, run.drain_s * 1e3, PALETTE[1]))
    spans += [("background write", s * 1e3, d * 1e3, BASELINE) for s, d in run.write_spans]
    return spans


def _flat_rank_state(model, optimizer, rank: int) -> dict[str, torch.Tensor]:
    """Model and Adam moments under rank-unique keys: each rank owns its shard, so
    DCP writes every rank's tensors instead of de-duplicating them as replicas."""
    state = {f"rank{rank}/model/{k}": v for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for param, moments in optimizer.state.items():
        for key, value in moments.items():
            if torch.is_tensor(value) and value.dim() > 0:
                state[f"rank{rank}/optim/{names[id(param)]}/{key}"] = value
    return state


@dataclass(frozen=True)
class SaverCalls:
    """One saver's calls on one rank, in seconds per call, the first (set-up) call included."""

    blocked_s: list[float]
    waited_s: list[float]
    total_s: list[float]


@dataclass(frozen=True)
class RankSaves:
    """What one rank measured: its shard's size and, per saver name, its calls."""

    rank: int
    state_bytes: int
    savers: dict[str, SaverCalls]


@dataclass(frozen=True)
class SaverSummary:
    """One saver over all ranks: the worst rank's first call, and its mean over the later calls.

    The worst rank, because a synchronous training step waits for its slowest rank.
    """

    first_blocked_s: float
    blocked_s: float
    total_s: float


SAVER_KINDS = ("sync", "async", "dcp_async")


def compare_savers_rank(directory: str, state_mb_per_rank: float, saves: int, steps_between: int = 2) -> RankSaves:
    """Rank function: the same shard saved by SyncSaver, AsyncSaver and DCP
    ``async_save`` (thread mode, its default) between real training steps.

    Before each timed save the previous one is drained and that wait is recorded
    apart (``waited_s``): ``blocked_s`` is then what the save call itself costs
    training, comparable across the three. The first call of each pays one-off
    set-up (allocating staging buffers; DCP's planning) and is reported as such.
    The :class:`RankSaves` it returns pickles back over the launcher's pipe as it is.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if saves < 2:
        raise ValueError(f"saves must be >= 2 (the first call is set-up), got {saves}")
    rank = dist.get_rank()
    root = Path(directory)
    model, optimizer = make_model(state_mb_per_rank, seed=rank)
    position = 0
    train_step(model, optimizer, position, "cpu")
    state_bytes = savers.state_bytes(_flat_rank_state(model, optimizer, rank))
    calls: dict[str, SaverCalls] = {}
    for kind in SAVER_KINDS:
        saver = savers.SAVERS[kind](root / kind / f"rank{rank}", keep=2) if kind in savers.SAVERS else None
        blocked, waited, total, future, done_at = [], [], [], None, {}
        dist.barrier()
        for index in range(saves):
            for _ in range(steps_between):
                position += 1
                train_step(model, optimizer, position, "cpu")
            state = _flat_rank_state(model, optimizer, rank)
            drain = time.perf_counter()
            if isinstance(saver, savers.AsyncSaver):
                saver.wait()
            elif future is not None:
                future.result()
            start = time.perf_counter()
            waited.append(start - drain)
            if saver is not None:
                blocked.append(saver.save(index, state).blocked_s)
            else:
                future = dcp.async_save(state, checkpoint_id=str(root / "dcp" / f"save{index}"))
                future.add_done_callback(
                    lambda _f, i=index, t0=start: done_at.__setitem__(i, time.perf_counter() - t0)
                )
                blocked.append(time.perf_counter() - start)
        if saver is not None:
            saver.close()
            total = [s.total_s for s in saver.history]
        else:
            future.result()
            total = [done_at[i] for i in range(saves)]
        calls[kind] = SaverCalls(blocked_s=blocked, waited_s=waited, total_s=total)
    dist.barrier()
    return RankSaves(rank=rank, state_bytes=state_bytes, savers=calls)


def summarise_comparison(results: list[RankSaves]) -> dict[str, SaverSummary]:
    """Per saver name, over ranks: first-call blocking, and the worst rank's mean of the
    later calls (a step waits for its slowest rank)."""
    def later_mean(values: list[float]) -> float:
        return sum(values[1:]) / len(values[1:])

    return {
        kind: SaverSummary(
            first_blocked_s=max(r.savers[kind].blocked_s[0] for r in results),
            blocked_s=max(later_mean(r.savers[kind].blocked_s) for r in results),
            total_s=max(later_mean(r.savers[kind].total_s) for r in results),
        )
        for kind in SAVER_KINDS
    }


def comparison_text(results: list[RankSaves], summary: dict[str, SaverSummary]) -> str:
    """The comparison as the lab and its benchmark print it: one line per saver, worst rank."""
    lines = [f"state per rank: {results[0].state_bytes / 1e6:.0f} MB on {len(results)} ranks"]
    for kind, row in summary.items():
        lines.append(f"{kind:>9}: first call blocked {row.first_blocked_s * 1e3:7.1f} ms, later calls blocked "
                     f"{row.blocked_s * 1e3:7.1f} ms, save to commit {row.total_s * 1e3:7.1f} ms (worst rank)")
    return "\n".join(lines)
