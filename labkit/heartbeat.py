"""What the supervisor reads from its ranks: heartbeat records, and the verdicts drawn from them.

Each rank appends one JSON line per phase of every step (:mod:`labkit.recovery_rank`);
a rank that stops writing is hung, one that writes slower compute times than the
others is a straggler (:mod:`labkit.stragglers`), one that exits is blamed by :func:`labkit.triage.blame`.
Everything here is pure bookkeeping over those records, so a test can feed it
records and check the verdict without starting a process.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from labkit import triage
from labkit.stragglers import StragglerRule, others_median, window_ratio


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
    compute_s: dict[int, dict[int, float]] = field(default_factory=dict)
    own_s: dict[int, deque] = field(default_factory=dict)
    others_s: dict[int, deque] = field(default_factory=dict)
    nonfinite: dict[int, dict] = field(default_factory=dict)
    straggler: tuple[int, str, int] | None = None
    """(rank, why, the last step the verdict judged): the first straggler the rule found."""
    steps_seen: int = 0
    steps_judged: int = 0
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
            self.compute_s.setdefault(record["step"], {})[rank] = record["compute_s"]
            self.steps_seen += 1
            self._judge(record["step"])
        elif event == "nonfinite":
            self.nonfinite[rank] = record
        elif event == "done":
            self.done.add(rank)

    def _judge(self, step: int) -> None:
        """Once every ready rank has reported ``step``, add it to each rank's window and judge the rank.
        A straggler's *own* compute is the outlier (everyone's step is slow, the all-reduce waits for it)."""
        times = self.compute_s[step]
        if len(times) < max(len(self.ready), 2):
            return
        del self.compute_s[step]
        self.steps_judged += 1
        if self.steps_judged <= self.rule.warmup:   # a start's first steps pay one-time costs (StragglerRule)
            return
        for rank, others in others_median(times).items():
            own_s = self.own_s.setdefault(rank, deque(maxlen=self.rule.window))
            others_s = self.others_s.setdefault(rank, deque(maxlen=self.rule.window))
            own_s.append(times[rank])
            others_s.append(others)
            if self.straggler is None and self.rule.is_slow(list(own_s), list(others_s)):
                self.straggler = (rank, f"fastest step {window_ratio(own_s, others_s):.2f}x the other ranks' "
                                        f"over steps {step - self.rule.window + 1}-{step} (threshold "
                                        f"{self.rule.factor:g}x)", step)


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
