"""Lab 7's exercises: what a run leaves on disk; which checkpoint a resume may trust."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

from labkit import checkpoint as ckpt
from labkit import checkpoint_stalls as stalls
from labkit.exercises import Verdict, check_code, predict

ResumePolicy = Callable[[Path], "int | None"]


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def bytes_on_disk(run: stalls.TrainingRun, prediction, *, state_mb: float, keep: int = 1,
                  device: str = "cpu") -> Verdict | None:
    """Exercise 7.1: the bytes ``run`` (a synchronous run) would leave in its checkpoint folder keeping
    only the newest ``keep`` checkpoints (the lab's runs keep 2)."""
    steps, save_every = run.steps, run.save_every
    measured_state = {}

    def measure() -> float:
        with tempfile.TemporaryDirectory(prefix="labkit-exercise-") as folder:
            run = stalls.train_with_checkpoints("sync", folder, state_mb=state_mb, steps=steps,
                                                save_every=save_every, keep=keep, device=device)
            measured_state["bytes"] = run.state_bytes
            return folder_bytes(Path(folder))

    def explain(got: float) -> str:
        state = measured_state["bytes"]
        return (f"{steps // save_every} saves of {state:,} bytes were written, but the saver keeps only the "
                f"newest {keep}: {got / state:.2f} checkpoints' worth is on disk. Retention, not frequency, sets "
                "the footprint; frequency sets the bytes written.")

    return predict("7.1", prediction, what=f"the bytes left on disk by a run of {steps} steps saving every "
                   f"{save_every} steps with keep={keep}", measure=measure,
                   context=(run.state_bytes, steps, save_every, keep), tolerance=0.02, unit="bytes", explain=explain)


def resume_policy(answer, *, device: str = "cpu") -> bool | None:
    """Exercise 7.2: ``latest_intact(directory)`` -> the newest step a resume may load, or ``None``."""
    def test(policy: ResumePolicy) -> str | None:
        with tempfile.TemporaryDirectory(prefix="labkit-exercise-") as folder:
            root = Path(folder)
            stalls.train_with_checkpoints("sync", root, state_mb=2, steps=6, save_every=2, keep=3, device=device)
            damage = [("intact", None), ("a flipped byte in step 6", lambda: _flip_byte(root, 6)),
                      ("step 4 never committed (no manifest)",
                       lambda: (ckpt.step_dir(root, 4) / ckpt.MANIFEST_FILE).unlink()),
                      ("step 2 truncated", lambda: _truncate(root, 2))]
            for (what, harm), want in zip(damage, (6, 4, 2, None)):
                if harm:
                    harm()
                got = policy(root)
                if got != want:
                    return f"after {what}, it chose {got}; a resume may trust step {want} at most"
        return None

    return check_code("7.2", answer, what="a function latest_intact(directory) -> step or None", test=test)


def _flip_byte(root: Path, step: int) -> None:
    state = ckpt.step_dir(root, step) / ckpt.STATE_FILE
    blob = bytearray(state.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    state.write_bytes(bytes(blob))


def _truncate(root: Path, step: int) -> None:
    state = ckpt.step_dir(root, step) / ckpt.STATE_FILE
    state.write_bytes(state.read_bytes()[:-100])
