"""What Labs 1 and 2 feed: an accelerator that is real wherever it can be.

A lab about keeping an accelerator busy needs an accelerator whose busy time is
measured, not declared:

* On a GPU, :class:`ModelStep` runs a small CNN there, as wide as
  :func:`model_width_for` measures it must be to run at the lab's target rate.
* On a CPU-only machine with two or more cores, :class:`CoreAccelerator` runs the
  same CNN in a process of its own, pinned to core(s) of its own, while the
  training loop and the loader workers are pinned to the others
  (:meth:`CoreAccelerator.host_side`). Like a GPU it computes beside the host
  without taking the loader's cores, and every millisecond it is busy is real
  work, so a loader that cannot keep up shows as a measured idle accelerator.
* :class:`StandInAccelerator` is an EMULATION that sleeps instead of computing.
  It is left for one-core machines, where no core can be set apart, and for
  Lab 2, whose asserts compare loaders against each other rather than against
  the accelerator.
"""

from __future__ import annotations

import math
import os
import signal
import time
import weakref
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
import torch.multiprocessing as mp

from labkit.devices import host_threads, time_ms
from labkit.processes import die_with_parent, kill_group
from labkit.step_attribution import ACCELERATOR_SPAN

STARTUP_TIMEOUT_S = 120.0
STEP_TIMEOUT_S = 120.0


class StandInAccelerator:
    """EMULATED accelerator: it takes time but no host CPU, because it sleeps.

    It stands for an accelerator only where none can be real (a one-core machine).
    Anything asserted about its busy fraction is close to true by construction:
    the sleep cannot be slowed by the loader.
    """

    def __init__(self, images_per_s: float):
        if images_per_s <= 0:
            raise ValueError(f"images_per_s must be > 0, got {images_per_s}")
        self.images_per_s = images_per_s

    def step(self, images: torch.Tensor, labels: torch.Tensor | None = None) -> None:
        """Sleep as long as the emulated step takes; a profiler sees the accelerator's step (compute)."""
        with torch.profiler.record_function(ACCELERATOR_SPAN):
            time.sleep(len(images) / self.images_per_s)

    def stolen_ms(self) -> float:
        """Nothing shares a sleep: 0."""
        return 0.0

    @contextmanager
    def host_side(self) -> Iterator[None]:
        """One intra-op thread for the training loop: the loader workers hold the cores."""
        with host_threads(1):
            yield


class ModelStep:
    """A real small CNN training step at low resolution."""

    def __init__(self, device: torch.device | str, *, width: int = 32, num_classes: int = 10, seed: int = 0):
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        torch.manual_seed(seed)
        self.device = torch.device(device)
        self.width = width
        self.model = torch.nn.Sequential(
            torch.nn.Conv2d(3, width, 3, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(width, 2 * width, 3, padding=1, stride=2), torch.nn.ReLU(),
            torch.nn.Conv2d(2 * width, 4 * width, 3, padding=1, stride=2), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4 * width, num_classes),
        ).to(self.device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)

    def step(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        x = images.to(self.device, non_blocking=True).float().div_(255)
        loss = torch.nn.functional.cross_entropy(self.model(x), labels.to(self.device, non_blocking=True))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()

    def stolen_ms(self) -> float:
        """0: a GPU is not shared with the machine's other programs (a CPU step here is the aside's point)."""
        return 0.0

    @contextmanager
    def host_side(self) -> Iterator[None]:
        yield


GPU_WIDTHS = (32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
"""Steps of about 1.5x in width, about 2x in work: doubling the width quadruples a conv's work, and on
an H200 the width-1024 model that 'at or below the target' picked ran 2.5x below it (3160 images/s for 8000)."""
CPU_WIDTHS = tuple(range(2, 33))


WIDTH_RULES = ("at or below", "closest", "at or above")
"""How :func:`model_width_for` picks among the widths around the target rate."""


def model_width_for(device: torch.device | str, *, images_per_s: float, batch_size: int, image_px: int,
                    widths: Sequence[int] = GPU_WIDTHS, repeats: int = 5, warmup: int = 2,
                    rule: str = "at or below") -> int:
    """The :class:`ModelStep` width whose measured step rate meets ``images_per_s`` by ``rule``.

    How much work keeps an accelerator busy depends on the accelerator: a width-32
    step is a few tiny kernels that a current GPU finishes before the host has the
    next batch ready, so even data in RAM would read as an idle accelerator. Rather
    than guess a width, time training steps on a resident batch at each width (best
    of ``repeats``), narrowest first, and stop at the first that runs at or below the
    target rate. ``rule``:

    - ``"at or below"``: that width (the widest if none is that slow);
    - ``"closest"``: that width or the one before it, whichever is nearer the target by
      ratio: on a CPU one width step changes the rate by 30-60%, so "at or below" alone
      can land far below it;
    - ``"at or above"``: the one before it unless it runs at the target exactly (the
      narrowest if none is fast enough): the accelerator is then at least as fast as
      asked, as Lab 1's must be (:data:`labkit.ladder.ACCELERATOR_OVER_LOADER`).
    """
    if rule not in WIDTH_RULES:
        raise ValueError(f"rule must be one of {WIDTH_RULES}, got {rule!r}")
    if images_per_s <= 0:
        raise ValueError(f"images_per_s must be > 0, got {images_per_s}")
    if not widths:
        raise ValueError("widths must name at least one width")
    if batch_size < 1 or image_px < 1:
        raise ValueError(f"batch_size and image_px must be >= 1, got {batch_size} and {image_px}")
    device = torch.device(device)
    images = torch.randint(0, 256, (batch_size, 3, image_px, image_px), dtype=torch.uint8, device=device)
    labels = torch.randint(0, 10, (batch_size,), device=device)
    previous: tuple[int, float] | None = None
    for width in sorted(widths):
        model = ModelStep(device, width=width)
        best_ms = min(time_ms(lambda: model.step(images, labels), device=device, warmup=warmup, repeats=repeats))
        rate = batch_size / (best_ms / 1e3)
        if rate <= images_per_s:
            if previous is None:
                return width
            if rule == "at or above" and rate < images_per_s:
                return previous[0]
            if rule == "closest" and math.log(previous[1] / images_per_s) < math.log(images_per_s / rate):
                return previous[0]
            return width
        previous = (width, rate)
    return max(widths)


def split_cores() -> tuple[set[int], set[int]] | None:
    """(the accelerator's core, the host's cores) from the cores this process may use; ``None`` with one."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    return {cores[-1]}, set(cores[:-1])


class CoreAccelerator:
    """A real model in a process pinned to its own core(s): a CPU-only machine's accelerator.

    The host hands each batch over as a GPU's host would: it copies the pixels into
    a buffer the accelerator reads (shared memory here, device memory there), says
    "go", and waits for the step to finish. The model's width is measured on the
    accelerator's own core, as on a GPU: the widest whose step runs at least at
    ``images_per_s``. Close it (or use ``with``) to stop the process; it also dies
    with its parent.
    """

    def __init__(self, *, images_per_s: float, batch_size: int, image_px: int,
                 cores: tuple[set[int], set[int]] | None = None):
        if images_per_s <= 0:
            raise ValueError(f"images_per_s must be > 0, got {images_per_s}")
        if batch_size < 1 or image_px < 1:
            raise ValueError(f"batch_size and image_px must be >= 1, got {batch_size} and {image_px}")
        split = cores or split_cores()
        if split is None:
            raise RuntimeError("CoreAccelerator needs two cores, one for it and one for the host; "
                               "this process may use one. Use StandInAccelerator there.")
        self.cores, self.host_cores = split
        self.batch_size = batch_size
        self._images = torch.zeros((batch_size, 3, image_px, image_px), dtype=torch.uint8).share_memory_()
        self._labels = torch.zeros(batch_size, dtype=torch.int64).share_memory_()
        context = mp.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=_serve, args=(child, self._images, self._labels, sorted(self.cores), images_per_s, os.getpid()),
            name="labkit-accelerator", daemon=True)
        self._process.start()
        child.close()
        self._sent = 0
        self._stolen_ms = 0.0
        self._finalizer = weakref.finalize(self, _stop, self._process, self._conn)
        self.width, self.images_per_s = self._receive(STARTUP_TIMEOUT_S, "starting up")

    def step(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        """Run one training step on the accelerator's core; return when it is done.

        A profiler sees the wait as :data:`~labkit.step_attribution.ACCELERATOR_SPAN`, so that
        ``labkit diagnose`` counts it as compute: the model's ops run in the other process.
        """
        with torch.profiler.record_function(ACCELERATOR_SPAN):
            self._step(images, labels)

    def _step(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        count = len(images)
        if not 0 < count <= self.batch_size:
            raise ValueError(f"a batch must hold 1 to {self.batch_size} images, got {count}")
        self._drain()
        self._images[:count].copy_(images)
        self._labels[:count].copy_(labels)
        self._sent += 1
        try:
            self._conn.send((self._sent, count))
        except OSError:
            self._died("running a step")
        while True:
            sequence, self._stolen_ms = self._receive(STEP_TIMEOUT_S, "running a step")
            if sequence == self._sent:
                return

    def stolen_ms(self) -> float:
        """How long the last step's process waited for its own core while another program held it.

        A GPU is not time-shared with the machine's other programs, but a core is:
        a compile or a test run beside the lab makes a step take twice as long, and
        the meter would count that as the accelerator being busy (a starved feed
        then reads as a busy accelerator). The kernel counts the wait
        (``schedstat``, :func:`run_queue_ms`), so the meter can leave it out.
        """
        return self._stolen_ms

    @contextmanager
    def host_side(self) -> Iterator[None]:
        """Pin the calling thread, and the loader workers it starts, to the host's cores.

        Workers are forked from this thread and inherit its affinity; the loop's
        own torch ops get one thread, so none lands on the accelerator's core.
        """
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, self.host_cores)
        try:
            with host_threads(1):
                yield
        finally:
            os.sched_setaffinity(0, before)

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> "CoreAccelerator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _drain(self) -> None:
        """Discard the answer to a step whose wait was interrupted (a learner's stop button)."""
        try:
            while self._conn.poll():
                self._conn.recv()
        except (EOFError, OSError):
            self._died("waiting for an earlier step")

    def _died(self, doing: str) -> None:
        self._process.join(timeout=1)
        self.close()
        raise RuntimeError(f"the accelerator process died while {doing} (exit code {self._process.exitcode}); "
                           "make a new one")

    def _receive(self, timeout_s: float, doing: str):
        deadline = time.monotonic() + timeout_s
        try:
            while not self._conn.poll(0.5):
                if not self._process.is_alive():
                    self._died(doing)
                if time.monotonic() > deadline:
                    self.close()
                    raise TimeoutError(f"the accelerator process took over {timeout_s:.0f} s {doing}; stopped it")
            kind, value = self._conn.recv()
        except (EOFError, OSError):
            self._died(doing)
        if kind == "error":
            self.close()
            raise RuntimeError(f"the accelerator process failed while {doing}: {value}")
        return value


def run_queue_ms() -> float:
    """Time this process's threads have been runnable but not running, in ms, since they started.

    The second field of ``/proc/self/task/*/schedstat``: the kernel's count of how
    long each thread waited on a run queue for a core. 0 where the kernel does
    not keep it (not Linux, or schedstats compiled out), so nothing is subtracted.
    """
    total_ns = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0.0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/schedstat") as stat:
                total_ns += int(stat.read().split()[1])
        except (OSError, ValueError, IndexError):   # a thread that ended, or no schedstat
            continue
    return total_ns / 1e6


def _serve(conn, images: torch.Tensor, labels: torch.Tensor, cores: list[int], images_per_s: float,
           parent_pid: int) -> None:
    """The accelerator process: pin, size the model on this core, then run steps on request."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a kernel interrupt stops the host's wait, not the device
    if os.getppid() != parent_pid:
        return
    try:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
        width = model_width_for("cpu", images_per_s=images_per_s, batch_size=len(images),
                                image_px=images.shape[-1], widths=CPU_WIDTHS, repeats=2, warmup=1, rule="at or above")
        model = ModelStep("cpu", width=width)
        measured_ms = min(time_ms(lambda: model.step(images, labels), warmup=1, repeats=2))
        conn.send(("ready", (width, len(images) / (measured_ms / 1e3))))
        waited_ms = run_queue_ms()   # from here on: a request's wake-up wait counts too
        while (request := conn.recv()) is not None:
            sequence, count = request
            model.step(images[:count], labels[:count])
            now_ms = run_queue_ms()
            conn.send(("done", (sequence, now_ms - waited_ms)))
            waited_ms = now_ms
    except (EOFError, KeyboardInterrupt):
        pass
    except Exception as error:  # noqa: BLE001 -- reported to the host, which raises it
        conn.send(("error", f"{type(error).__name__}: {error}"))


def _stop(process, conn) -> None:
    try:
        conn.send(None)
    except (OSError, ValueError):   # already gone, or already closed
        pass
    process.join(timeout=2)
    if process.is_alive():
        kill_group(process.pid, grace_s=1)
    process.join(timeout=1)
    conn.close()


Accelerator = StandInAccelerator | CoreAccelerator | ModelStep


BUSY_NOT_MEASURED = ("skipped: this accelerator is the sleeping EMULATION, which no loader can slow, so a busy "
                     "fraction or hidden compute time measured against it would hold by construction; these "
                     "asserts run where the accelerator computes (a GPU, or a CPU with a core to set apart)")


def busy_time_is_measured(accelerator: Accelerator) -> bool:
    """Whether the accelerator's busy time is work it did, so that asserts on busy fractions can fail.

    The sleeping :class:`StandInAccelerator` takes the time it was told to take and no
    host CPU: a starved loader cannot slow its steps, nor a busy one steal from them.
    A lab prints :data:`BUSY_NOT_MEASURED` instead of asserting where this is False.
    """
    return not isinstance(accelerator, StandInAccelerator)


def describe(accelerator: Accelerator) -> str:
    """One line for a notebook: what the accelerator is, and whether it is real."""
    if isinstance(accelerator, CoreAccelerator):
        return (f"a real CNN (width {accelerator.width}) in its own process on core(s) {sorted(accelerator.cores)}, "
                f"measured there at {accelerator.images_per_s:.0f} images/s; the loop and loader workers "
                f"run on core(s) {sorted(accelerator.host_cores)}")
    if isinstance(accelerator, StandInAccelerator):
        return (f"EMULATED: sleeps batch / {accelerator.images_per_s:.0f} images/s and uses no CPU, so its busy "
                "time is chosen, not measured (a real model needs a core of its own, and this process may use one)")
    return f"a real CNN (width {accelerator.width}) on {accelerator.device}"


def accelerator_for(device: torch.device | str, *, images_per_s: float, batch_size: int, image_px: int,
                    emulate: bool = False) -> StandInAccelerator | CoreAccelerator | ModelStep:
    """The accelerator a lab's loader feeds, at about ``images_per_s``.

    A GPU: a real :class:`ModelStep` there. A CPU with two or more cores: a
    :class:`CoreAccelerator`. One core, or ``emulate=True``: the sleeping
    :class:`StandInAccelerator`.
    """
    device = torch.device(device)
    if device.type != "cpu":
        width = model_width_for(device, images_per_s=images_per_s, batch_size=batch_size, image_px=image_px,
                                rule="closest")
        return ModelStep(device, width=width)
    if emulate or split_cores() is None:
        return StandInAccelerator(images_per_s)
    return CoreAccelerator(images_per_s=images_per_s, batch_size=batch_size, image_px=image_px)
