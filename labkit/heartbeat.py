"""What the supervisor reads from its ranks: heartbeat records, and the verdicts drawn from them.

Each rank appends one JSON line per phase of every step (:mod:`labkit.recovery_rank`);
a rank that stops writing is hung, one that writes slower compute times than the
others is a straggler, one that exits is blamed by :func:`labkit.triage.blame`.
Everything here is pure bookkeeping over those records, so a test can feed it
records and check the verdict without starting a process.
"""

from __future__ import annotations

import json
import statistics
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from labkit import triage


@dataclass(frozen=True)
class StragglerRule:
    """A rank straggles when its own compute time exceeds ``factor`` x the other ranks' median,
    by more than ``min_excess_s``, ``patience`` steps running."""

    factor: float = 3.0
    min_excess_s: float = 0.15
    patience: int = 3

    def __post_init__(self) -> None:
        if self.factor <= 1:
            raise ValueError(f"straggler factor must be > 1, got {self.factor}")
        if self.min_excess_s < 0:
            raise ValueError(f"straggler min_excess_s must be >= 0, got {self.min_excess_s}")
        if self.patience < 1:
            raise ValueError(f"straggler patience must be >= 1, got {self.patience}")


def read_new(path: Path, offsets: dict[Path, int]) -> list[dict]:
    """The complete records appended to ``path`` since the last call (a line still being written waits)."""
    if not path.exists():
        return []
    with open(path) as handle:
        handle.seek(offsets.get(path, 0))
        data = handle.read()
    complete = data[: data.rfind("\n") + 1]
    offsets[path] = offsets.get(path, 0) + len(complete)
    return [json.loads(line) for line in complete.splitlines() if line]


@dataclass
class HeartbeatWatch:
    """The supervisor's view of one attempt while it runs."""

    rule: StragglerRule = field(default_factory=StragglerRule)
    last_t: dict[int, float] = field(default_factory=dict)
    progress: dict[int, tuple[int, int]] = field(default_factory=dict)
    compute_s: dict[int, deque] = field(default_factory=dict)
    slow_streak: dict[int, int] = field(default_factory=dict)
    nonfinite: dict[int, dict] = field(default_factory=dict)
    straggler: tuple[int, str] | None = None
    steps_seen: int = 0
    done: set[int] = field(default_factory=set)
    ready: set[int] = field(default_factory=set)
    errors: dict[int, dict] = field(default_factory=dict)

    def feed(self, rank: int, record: dict) -> None:
        self.last_t[rank] = record["t"]
        event = record["event"]
        if event == "ready":
            self.ready.add(rank)
        elif event == "error":
            self.errors[rank] = record
        elif event == "computed":
            self.progress[rank] = (record["step"], 1)
        elif event == "step":
            self.progress[rank] = (record["step"], 2)
            self._judge(rank, record["compute_s"])
            self.compute_s.setdefault(rank, deque(maxlen=20)).append(record["compute_s"])
            self.steps_seen += 1
        elif event == "nonfinite":
            self.nonfinite[rank] = record
        elif event == "done":
            self.done.add(rank)

    def _judge(self, rank: int, compute_s: float) -> None:
        """A straggler's *own* compute time is an outlier against the other ranks'
        (everyone's step time is slow, because the all-reduce waits for it)."""
        others = [t for r, times in self.compute_s.items() if r != rank for t in times]
        if not others:
            return
        baseline = statistics.median(others)
        slow = compute_s > self.rule.factor * baseline and compute_s - baseline > self.rule.min_excess_s
        self.slow_streak[rank] = self.slow_streak.get(rank, 0) + 1 if slow else 0
        if self.slow_streak[rank] >= self.rule.patience and self.straggler is None:
            self.straggler = (rank, f"compute {compute_s * 1e3:.0f} ms vs median {baseline * 1e3:.0f} ms "
                                    f"on the other ranks, {self.slow_streak[rank]} steps running")


def exit_verdict(failed: list[tuple[int, int]], errors: dict[int, dict]) -> tuple[int, str]:
    """(blamed rank, how it ended) among the ranks that exited (see :func:`labkit.triage.blame`)."""
    rank, code = triage.blame(failed, errors)
    how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
    if rank in errors:
        how += f" ({errors[rank]['error_type']}: {errors[rank]['message'][:200]})"
    return rank, how


def silence_verdict(
    watch: HeartbeatWatch, world_size: int, now: float, since_launch_s: float,
    heartbeat_timeout_s: float, startup_timeout_s: float,
) -> tuple[int, str] | None:
    """A hang, wherever it strikes: (blamed rank, detail), or None.

    Starting up (imports, rendezvous, loading the checkpoint) may take up to
    ``startup_timeout_s``. Once every rank has reported ready, silence from all of
    them for ``heartbeat_timeout_s`` is a hang, at the attempt's first step as at
    its hundredth (the others wait for the hung rank in the all-reduce): both are
    recovered the same way, from the last checkpoint on a spare.
    """
    if len(watch.ready) < world_size:
        if since_launch_s <= startup_timeout_s:
            return None
        rank = min(set(range(world_size)) - watch.ready)
        return rank, f"rank {rank} was not ready within startup_timeout_s={startup_timeout_s:g}s"
    if now - max(watch.last_t.values()) <= heartbeat_timeout_s:
        return None
    rank = min(set(range(world_size)) - watch.done, key=lambda r: (watch.progress.get(r, (-1, 0)), r))
    stalled = watch.progress.get(rank, (-1, 0))[0]
    where = f"after step {stalled}" if stalled >= 0 else "before its first step"
    return rank, f"no heartbeat for {heartbeat_timeout_s:g}s; rank {rank} stuck {where}"
