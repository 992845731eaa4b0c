"""Run jobs two at a time: never two of one group at once, and an *alone* job with nothing beside it.

The sabotage tests run 48 parts of notebooks, one kernel each. A kernel spends much of its time
waiting (ranks starting, links shaped to a slow rate, a stand-in accelerator that sleeps), so two
of them share the 2-core box well. Two runs of one notebook would share its files (a cache, a
checkpoint folder), so a group is a notebook. A job is *alone* when what it asserts depends on
having the cores to itself (Lab 1 pins its accelerator to one core and its loader to the other).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import Future
from typing import Callable, Generic, Hashable, TypeVar

J = TypeVar("J", bound=Hashable)
R = TypeVar("R")

SLOTS = 2


class TwoAtATime(Generic[J, R]):
    """Start running ``jobs`` (in order, alone ones first) on two threads; :meth:`result` waits for one."""

    def __init__(self, jobs: list[J], run: Callable[[J], R], group: Callable[[J], str],
                 alone: Callable[[J], bool]) -> None:
        if len(set(jobs)) != len(jobs):
            raise ValueError("jobs must be distinct")
        self._run, self._group, self._alone = run, group, alone
        self._pending = sorted(jobs, key=lambda job: not alone(job))   # stable: alone ones first, in order
        self._running: list[J] = []
        self._futures: dict[J, Future[R]] = {job: Future() for job in jobs}
        self._changed = threading.Condition()
        self.timeline: list[tuple[J, float, float]] = []
        """(job, start, end) in ``time.monotonic()`` seconds, in the order the jobs ended."""
        self._threads = [threading.Thread(target=self._work, name=f"two-at-a-time-{i}", daemon=True)
                         for i in range(SLOTS)]
        for thread in self._threads:
            thread.start()

    def result(self, job: J) -> R:
        """``run(job)``'s value, or its exception raised here; waits until it has run."""
        return self._futures[job].result()

    def stop(self, timeout_s: float = 60.0) -> None:
        """Start nothing more; wait up to ``timeout_s`` for what is running to end."""
        with self._changed:
            for job in self._pending:
                self._futures[job].cancel()
            self._pending.clear()
            self._changed.notify_all()
        for thread in self._threads:
            thread.join(timeout_s)

    def _can_start(self, job: J) -> bool:
        if self._alone(job):
            return not self._running
        return all(not self._alone(other) and self._group(other) != self._group(job) for other in self._running)

    def _take(self) -> J | None:
        """The pending job to start now; None once none is left.

        An alone job waits for both threads to be free and nothing starts before it. Otherwise the
        job of the group with the most jobs left goes first: runs of one group cannot overlap, so a
        group left over at the end would run its jobs one at a time.
        """
        with self._changed:
            while self._pending:
                first = self._pending[0]
                if self._alone(first):
                    startable = [first] if self._can_start(first) else []
                else:
                    startable = [job for job in self._pending if self._can_start(job)]
                if startable:
                    left = Counter(self._group(job) for job in self._pending)
                    job = max(startable, key=lambda job: left[self._group(job)])   # the first of equals
                    self._pending.remove(job)
                    self._running.append(job)
                    return job
                self._changed.wait()
            return None

    def _work(self) -> None:
        while (job := self._take()) is not None:
            future, start = self._futures[job], time.monotonic()
            try:
                future.set_result(self._run(job))
            except BaseException as exc:   # the test that asks for this job raises it
                future.set_exception(exc)
            finally:
                with self._changed:
                    self.timeline.append((job, start, time.monotonic()))
                    self._running.remove(job)
                    self._changed.notify_all()
