"""Experiment sizes for the machine the labs run on.

Every lab sizes its experiments from one :class:`Profile`, so the same notebook
runs unchanged on a 2-core CI box, on one GPU and on a multi-GPU node. Labs keep
their own size tables (``{"ci": ..., "gpu": ..., "multi-gpu": ...}``, each entry
a frozen dataclass that checks itself with :func:`require_at_least`) next to
their code and read them with :meth:`Profile.pick`; this module only decides
*which* profile applies.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, TypeVar

import torch

PROFILE_NAMES = ("ci", "gpu", "multi-gpu")
ENV_VAR = "LABKIT_PROFILE"

T = TypeVar("T")


@dataclass(frozen=True)
class Profile:
    """What a lab may assume about the machine.

    ``device`` is where single-device experiments run. ``ranks`` /
    ``rank_device`` / ``backend`` describe distributed experiments: NCCL needs one
    GPU per rank, so a single-GPU machine still runs its multi-rank labs as gloo
    ranks on the CPU, and says so.
    """

    name: str
    device: str
    ranks: int
    rank_device: str
    backend: str

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"

    def pick(self, table: Mapping[str, T]) -> T:
        """Return this profile's entry of a lab's size table."""
        if self.name not in table:
            raise KeyError(
                f"size table has no entry for profile {self.name!r}; "
                f"it has {sorted(table)}; add one (profiles are {PROFILE_NAMES})"
            )
        return table[self.name]

    def backend_for(self, world_size: int) -> str:
        """NCCL when every rank gets a GPU of its own, else gloo.

        NCCL ranks call ``cuda.set_device(local_rank)``, so a 4-rank lab on a 2-GPU
        node would fail on rank 2; there its ranks run on the CPU instead.
        """
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        return self.backend if world_size <= self.ranks else "gloo"

    def describe(self) -> str:
        where = "the CPU" if self.device == "cpu" else "one GPU"
        ranks_on = "CPU processes" if self.rank_device == "cpu" else "GPUs"
        return (
            f"profile {self.name!r}: single-device experiments on {where}; "
            f"distributed experiments on {self.ranks} {ranks_on} over {self.backend}"
        )


def require_at_least(sizes: object, minimum: float, *fields: str) -> None:
    """Raise a ValueError naming the first of ``fields`` of ``sizes`` below ``minimum``.

    Size tables are checked when they are built, so a typo fails at import with the
    field's name, not minutes into a run with a shape error.
    """
    for name in fields:
        value = getattr(sizes, name)
        if value < minimum:
            raise ValueError(f"{type(sizes).__name__}.{name} must be >= {minimum}, got {value}")


def detect_profile_name() -> str:
    """The profile this machine would pick without ``LABKIT_PROFILE``."""
    if not torch.cuda.is_available():
        return "ci"
    return "multi-gpu" if torch.cuda.device_count() > 1 else "gpu"


def profile(name: str | None = None) -> Profile:
    """The active profile: ``name``, else ``$LABKIT_PROFILE``, else auto-detected.

    Asking for a GPU profile on a machine without one is an error rather than a
    silent CPU run, because the lab's sizes would be wrong for the CPU.
    """
    chosen = name or os.environ.get(ENV_VAR) or detect_profile_name()
    if chosen not in PROFILE_NAMES:
        raise ValueError(
            f"profile must be one of {PROFILE_NAMES}, got {chosen!r} "
            f"(set {ENV_VAR} or pass name=)"
        )
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if chosen == "ci":
        return Profile("ci", device="cpu", ranks=2, rank_device="cpu", backend="gloo")
    if gpus == 0:
        raise RuntimeError(
            f"profile {chosen!r} needs a CUDA GPU and this machine has none; "
            f"unset {ENV_VAR} or set it to 'ci'"
        )
    if chosen == "gpu":
        return Profile("gpu", device="cuda", ranks=2, rank_device="cpu", backend="gloo")
    if gpus < 2:
        raise RuntimeError(
            f"profile 'multi-gpu' needs at least 2 GPUs, this machine has {gpus}; "
            f"use {ENV_VAR}=gpu"
        )
    return Profile("multi-gpu", device="cuda", ranks=gpus, rank_device="cuda", backend="nccl")
