"""Reference answers to Lab 7's exercises."""

from pathlib import Path

from labkit import checkpoint as ckpt
from labkit.exercises import Answer

EX_7_1 = Answer(
    right=lambda state_bytes, steps, save_every, keep: min(keep, steps // save_every) * state_bytes,
    wrong=lambda state_bytes, steps, save_every, keep: (steps // save_every) * state_bytes,
    wrong_because="counts every save; the saver deletes all but the newest `keep`",
)


def _latest_intact(directory: Path) -> int | None:
    """Newest first, the first folder whose manifest and checksums hold."""
    for step, folder in ckpt.list_checkpoints(directory):
        if ckpt.verify(folder) is None:
            return step
    return None


EX_7_2 = Answer(
    right=_latest_intact,
    wrong=lambda directory: max((step for step, _ in ckpt.list_checkpoints(directory)), default=None),
    wrong_because="trusts the newest folder without checking its manifest and checksums",
)
