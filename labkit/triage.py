"""Is a failure the hardware's or the program's? What decides whether a retry can help.

Replacing a node helps only if the node was at fault. A rank that dies of a
signal, hangs, straggles or reports a non-finite loss may sit on bad hardware:
cordon its node and retry on a spare. A rank that raises ``TypeError`` because
``train_kwargs`` has a typo will raise it again on every node; retrying burns the
spares and buries the traceback. So each rank reports the exception that ended it
(:func:`error_record`), the supervisor blames the rank that failed first in spirit
(:func:`blame`) and asks a :class:`RetryJudge` whether a fresh node could help.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass

PROGRAM, DEVICE, COMMUNICATION = "program", "device", "communication"
_BLAME_ORDER = {PROGRAM: 0, DEVICE: 1, COMMUNICATION: 2}
_TRACEBACK_CHARS = 8000


def _raised_inside(exc: BaseException, package: str) -> bool:
    frame = exc.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    return frame is not None and f"{os.sep}{package}{os.sep}" in frame.tb_frame.f_code.co_filename


def classify_exception(exc: BaseException) -> str:
    """:data:`DEVICE`, :data:`COMMUNICATION` or :data:`PROGRAM`.

    Communication: a ``torch.distributed`` error, or a runtime error raised inside
    ``torch.distributed`` -- gloo reports a peer that died as a plain
    ``RuntimeError`` ("Connection closed by peer"), so such a rank is usually the
    victim of another's failure. Device: a CUDA or other accelerator error.
    Anything else the program raised itself, and would raise on any node.
    """
    import torch
    import torch.distributed as dist

    if isinstance(exc, getattr(torch, "AcceleratorError", ())) or "CUDA error" in str(exc):
        return DEVICE
    if isinstance(exc, dist.DistError):
        return COMMUNICATION
    if isinstance(exc, (RuntimeError, OSError)) and _raised_inside(exc, os.path.join("torch", "distributed")):
        return COMMUNICATION
    return PROGRAM


def error_record(exc: BaseException) -> dict[str, str]:
    """What a rank logs about the exception that ends it (JSON-ready)."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {
        "error_type": type(exc).__qualname__,
        "message": str(exc)[:2000],
        "origin": classify_exception(exc),
        "traceback": text[-_TRACEBACK_CHARS:],
    }


def blame(failed: list[tuple[int, int]], errors: dict[int, dict]) -> tuple[int, int]:
    """Of the ranks that exited, ``(rank, exit code)`` of the one to blame.

    A rank killed by a signal first, then one whose own code raised, then a device
    error; a rank whose collective lost its peer is a victim, blamed last.
    """
    def order(rank_code: tuple[int, int]) -> tuple[bool, int, int]:
        rank, code = rank_code
        origin = errors.get(rank, {}).get("origin")
        return code >= 0, _BLAME_ORDER.get(origin, len(_BLAME_ORDER)), rank

    return min(failed, key=order)


NODE_CAUSES = ("exit", "hang", "straggler")
"""Detections that may come from the node: a rank that died, hung or slowed down."""


def node_at_fault(cause: str) -> bool:
    """May a fresh node help with a failure detected as ``cause``? Then cordon the node and move to a spare.

    A non-finite loss is the program's: the same weights and the same batch give
    the same NaN on any node (a real fleet sees silent data corruption too, but
    that is the rare case, found by re-running the step elsewhere). The run
    resumes from the last checkpoint on the same nodes, and none is cordoned.
    """
    if cause == "nonfinite":
        return False
    if cause in NODE_CAUSES:
        return True
    raise ValueError(f"cause must be one of {(*NODE_CAUSES, 'nonfinite')}, got {cause!r}")


@dataclass
class RetryJudge:
    """Decides, failure after failure, whether a fresh node could help.

    Two rules. A program error (see :func:`classify_exception`) stops the run at
    once. Any other failure that strikes before the attempt completed a step, in
    the same way (cause, rank, exception type) as the attempt before it, stops it
    too: the node was replaced in between, so the failure travels with the job.
    A hang at the first step is therefore retried once, like any hang, and stops
    the run only if the fresh node hangs there as well.
    """

    _previous: tuple | None = None

    def why_stop(self, cause: str, rank: int, error: dict | None, completed_a_step: bool) -> str | None:
        """Why a retry cannot help (stop the run), or ``None`` (retry on a spare)."""
        if error is not None and error.get("origin") == PROGRAM:
            return (f"rank {rank} raised {error['error_type']}: {error['message']}. That is an error in the "
                    f"program, not a node failure; every node would raise it again")
        signature = (cause, rank, error and error.get("error_type"))
        repeated = not completed_a_step and signature == self._previous
        self._previous = None if completed_a_step else signature
        if repeated:
            return (f"rank {rank} failed the same way ({cause}) before completing a step on two nodes in a "
                    f"row: the failure travels with the job, not with the node")
        return None
