"""labkit: the code behind the labs of "why adding GPUs barely shortened the run".

Each lab opens the module its first cell names. The core every lab shares:
``profile()`` (experiment sizes for this machine), ``devices`` (honest timing),
``meter`` (wait vs compute), ``launcher`` (real ranks), ``dsops`` (DeepSpeed op
cache), ``atomic`` (crash-safe writes) and ``plots`` (one style).
"""

import os

# Daft sends usage analytics unless told not to; the course's traffic stays on this machine
# (loopback and its own namespaces). Set here, before any labkit module imports daft.
os.environ.setdefault("DAFT_ANALYTICS_ENABLED", "0")


def _deepspeed_on_the_cpu_where_there_is_no_gpu() -> None:
    """Name the CPU accelerator for DeepSpeed where torch sees no GPU: it would pick the CPU anyway, but
    first prints a warning ("...we were unable to detect it") into the learner's notebook output."""
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"


_deepspeed_on_the_cpu_where_there_is_no_gpu()

from labkit.profiles import Profile, profile  # noqa: E402

__all__ = ["Profile", "profile"]
__version__ = "0.1.0"
