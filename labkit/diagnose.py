"""Profile a training loop, unmodified, and split its steps into the course's bottlenecks.

The course teaches that each bottleneck needs a different experiment; this asks
the question of *your* job. :class:`Diagnosis` wraps a training loop (or, run as
``python -m labkit.diagnose SCRIPT.py ARGS`` under ``torchrun``, a whole script)
and profiles it with ``torch.profiler``. Nothing in the script changes: steps
are delimited by a global optimizer-step hook
(``torch.optim.optimizer.register_optimizer_step_post_hook``); a loop whose
optimizer steps in another process (Lab 1's accelerator on a CPU-only machine)
marks its steps with :meth:`Diagnosis.step` instead. The saves the
tool knows are wrapped in named spans so that checkpoint time shows in the trace
(nothing else labels it): ``torch.save``, ``os.fsync``, DCP's ``save``/``async_save``,
and the course's own savers' ``save`` whole (:mod:`labkit.savers`).

The first ``baseline_steps`` steps run unprofiled and are timed from the hook
alone, so the profiler's own cost is measured, not assumed: ``overhead`` is the
profiled step time over the unprofiled one, each the mean of its steps (the
first step, which starts whatever the loop starts, left out). Then ``warmup`` steps let the
profiler settle and ``steps`` are recorded. In script mode the script is stopped
right after (an exception raised from the hook, which the script does not
catch, since it is a ``BaseException``), every rank at the same step, so no rank
is left waiting in a collective.

:mod:`labkit.step_attribution` does the splitting; :mod:`labkit.diagnosis_report`
launches ranks, merges them and writes the verdict.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import runpy
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from labkit import step_attribution


class EnoughSteps(BaseException):
    """Raised from the optimizer hook once the profiled steps are recorded: ends the script, not the run."""


@dataclass(frozen=True)
class StateBytes:
    """What the optimizer's tensors hold on this rank, read at the last profiled step."""
    parameters: int
    gradients: int
    optimizer_state: int


@dataclass(frozen=True)
class RankResult:
    rank: int
    world_size: int
    shares: dict[str, float]
    step_ms: float
    unprofiled_step_ms: float
    memory_bound_share_of_compute: float
    state_bytes: StateBytes | None
    """None where the steps were marked by hand: no optimizer on this thread to read them from."""
    trace: str

    @property
    def overhead(self) -> float:
        return self.step_ms / self.unprofiled_step_ms


def _rank() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _state_bytes(optimizer: torch.optim.Optimizer | None) -> StateBytes | None:
    if optimizer is None:
        return None
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    size = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    return StateBytes(size(params), size(p.grad for p in params if p.grad is not None), size(state))


class Diagnosis:
    """Profile ``steps`` optimizer steps of whatever trains inside the ``with`` block.

    ``stop_script=True`` (script mode) raises :class:`EnoughSteps` once they are
    recorded; otherwise later steps simply run unprofiled. ``result`` is filled
    when the profiled steps end. With ``steps_from_optimizer=False`` no hook is
    registered and the loop calls :meth:`step` at the end of each step, as it
    would call ``torch.profiler.profile.step``.
    """

    def __init__(self, out: str | Path, *, steps: int = 10, warmup: int = 2, baseline_steps: int = 5,
                 ridge_flop_per_byte: float = float("inf"), stop_script: bool = False,
                 steps_from_optimizer: bool = True):
        for name, value, low in (("steps", steps, 1), ("warmup", warmup, 1), ("baseline_steps", baseline_steps, 2)):
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        self.out = Path(out)
        self.steps, self.warmup, self.baseline_steps = steps, warmup, baseline_steps
        self.ridge = ridge_flop_per_byte
        self.stop_script = stop_script
        self.steps_from_optimizer = steps_from_optimizer
        self.result: RankResult | None = None
        self._marks: list[float] = []
        self._optimizer: torch.optim.Optimizer | None = None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Diagnosis:
        self.out.mkdir(parents=True, exist_ok=True)
        _start_kineto_once()
        # The first step closes when the first optimizer step ends; "wait" covers the unprofiled timing steps.
        self._profiler = profile(activities=_activities(), record_shapes=True, with_flops=True,
                                 schedule=schedule(wait=self.baseline_steps, warmup=self.warmup,
                                                   active=self.steps, repeat=1),
                                 on_trace_ready=self._trace_ready)
        self._stack.enter_context(_checkpoint_spans())
        if self.steps_from_optimizer:
            self._stack.callback(register_optimizer_step_post_hook(self._on_step).remove)
        with _without_kineto_chatter():
            self._profiler.start()
        self._stack.callback(self._stop_profiler)
        return self

    @property
    def profiled_window(self) -> tuple[float, float]:
        """``time.perf_counter()`` at the start and end of the profiled (active) steps, so another clock can be
        read over the same steps; a step ends at its optimizer step."""
        first = self.baseline_steps + self.warmup - 1
        if len(self._marks) < first + self.steps + 1:
            raise RuntimeError(f"the profiled steps have not ended: {len(self._marks)} steps seen, "
                               f"{first + self.steps + 1} needed")
        return self._marks[first], self._marks[first + self.steps]

    @property
    def steps_seen(self) -> int:
        """Steps marked so far (by the optimizer hook or :meth:`step`)."""
        return len(self._marks)

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _stop_profiler(self) -> None:
        with contextlib.suppress(Exception), _without_kineto_chatter():  # already stopped when its steps ended
            self._profiler.stop()

    def step(self) -> None:
        """End a training step, where no optimizer step on this thread marks it (``steps_from_optimizer=False``)."""
        if self.steps_from_optimizer:
            raise RuntimeError("this Diagnosis marks steps at each optimizer step; pass steps_from_optimizer=False "
                               "to mark them with step()")
        self._mark()

    def _on_step(self, optimizer: torch.optim.Optimizer, *_: object) -> None:
        if self.result is None:
            self._optimizer = optimizer
        self._mark()

    def _mark(self) -> None:
        if self.result is not None:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._marks.append(time.perf_counter())
        with _without_kineto_chatter():
            self._profiler.step()
        if self.result is not None and self.stop_script:
            raise EnoughSteps

    def _trace_ready(self, prof: torch.profiler.profile) -> None:
        rank, world = _rank()
        trace = self.out / f"trace-rank{rank}.json"
        prof.export_chrome_trace(str(trace))
        breakdown = step_attribution.attribute_rank(json.loads(trace.read_text()), rank,
                                                    ridge_flop_per_byte=self.ridge)
        # The mean of the unprofiled steps after the first, as the profiled step time is a mean: a loader whose
        # workers deliver batches in pairs alternates short and long steps, and a median took the short ones.
        unprofiled_s = (self._marks[self.baseline_steps - 1] - self._marks[0]) / (self.baseline_steps - 1)
        self.result = RankResult(rank, world, breakdown.shares(), breakdown.step_ms,
                                 1e3 * unprofiled_s, breakdown.memory_bound_share_of_compute,
                                 _state_bytes(self._optimizer), trace.name)
        (self.out / f"rank{rank}.json").write_text(json.dumps(asdict(self.result), indent=1))


_kineto_started = False


def _start_kineto_once() -> None:
    """Record one empty trace, once per process, before the loop's first step.

    The first trace a process records starts Kineto: 0.9 s here, spent inside whichever step the
    profiler starts recording in. A loader's workers fill their prefetch queue meanwhile, and the first
    profiled steps then find their batches waiting: Lab 1's file path read a data share of 0.54 beside
    0.72-0.73 in the next two diagnoses in the same process.
    """
    global _kineto_started
    if not _kineto_started:
        with _without_kineto_chatter(), profile(activities=_activities()):
            pass
        _kineto_started = True


@contextlib.contextmanager
def _without_kineto_chatter():
    """File descriptor 2 to /dev/null while the profiler starts, steps or stops.

    Kineto (pytorch/kineto#1325, in torch 2.13) writes a "USDT ... profiler_start"
    and "... profiler_stop" line to the process's stderr at each start and stop,
    below Python, where no logging setting reaches; in a notebook they landed in
    the learner's output. Only these calls are silenced, not the training.
    """
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _activities() -> list[ProfilerActivity]:
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])


@contextlib.contextmanager
def _checkpoint_spans():
    """The saves the tool knows, each inside a named span while profiling; the originals back afterwards.

    ``fsync`` is how a save makes its bytes durable, and on a slow disk it is most of
    the save: without it, a checkpoint written the way Lab 7 writes one (serialise,
    then fsync, then rename) showed only its serialisation as checkpoint time. A save
    is more than those two calls (its checks, renames, manifest, deleting old
    checkpoints), and an async save may first wait for the previous write: seen through
    ``torch.save`` and ``fsync`` alone, Lab 7's synchronous saves were 0.82-0.86 of what
    the loop timed around them (10 runs), and its async saves' waits not checkpoint
    at all. So the course's own savers, which the tool can name, are wrapped whole:
    whatever their ``save`` holds the training thread for is checkpoint time.
    """
    import torch.distributed.checkpoint as dcp

    from labkit.savers import AsyncSaver, SyncSaver

    targets = ([(torch, "save"), (os, "fsync"), (SyncSaver, "save"), (AsyncSaver, "save")]
               + [(dcp, name) for name in ("save", "async_save") if hasattr(dcp, name)])
    originals = [(owner, name, getattr(owner, name)) for owner, name in targets]
    for owner, name, original in originals:
        setattr(owner, name, _in_span(original, f"{step_attribution.CHECKPOINT_SPAN} ({owner.__name__}.{name})"))
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def _in_span(fn, label: str):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with record_function(label):
            return fn(*args, **kwargs)
    return wrapped


def ridge_of_this_machine() -> float:
    """Lab 3's ridge, FLOP per byte, measured now with plain torch (a matmul and a copy, about a second)."""
    from labkit.reference_loops import plain_copy_bytes_per_s, plain_matmul_flops

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return plain_matmul_flops(device, 1024) / plain_copy_bytes_per_s(device, 32 * 2**20)


def main(argv: list[str] | None = None) -> int:
    """One rank: ``python -m labkit.diagnose [--steps K] [--warmup W] --out DIR SCRIPT.py [ARGS...]``."""
    parser = argparse.ArgumentParser(prog="python -m labkit.diagnose")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--baseline-steps", type=int, default=5)
    parser.add_argument("--ridge", type=float, default=None, help="FLOP/byte; measured here when omitted")
    parser.add_argument("--out", required=True)
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    script = Path(args.script)
    if not script.is_file():
        parser.error(f"SCRIPT {script} is not a file; give the path of your training script")
    ridge = args.ridge if args.ridge is not None else ridge_of_this_machine()
    sys.argv = [str(script), *args.args]
    sys.path.insert(0, str(script.resolve().parent))
    diagnosis = Diagnosis(args.out, steps=args.steps, warmup=args.warmup, baseline_steps=args.baseline_steps,
                          ridge_flop_per_byte=ridge, stop_script=True)
    with contextlib.suppress(EnoughSteps), diagnosis:
        runpy.run_path(str(script), run_name="__main__")
    if diagnosis.result is None:
        print(f"labkit.diagnose: {script} ended after {diagnosis.steps_seen} optimizer steps; it needs "
              f"{args.baseline_steps + args.warmup + args.steps} (lower --steps/--warmup or train longer)",
              file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    from labkit.processes import exit_without_finalizing

    # The script was cut off mid-run: its process group, loader workers and threads are not shut down, and
    # finalizing the interpreter could block on them. The trace and rank{N}.json are written by now.
    exit_without_finalizing(main())
