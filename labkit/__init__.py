"""labkit: the code behind the labs of "why adding GPUs barely shortened the run".

Each lab opens the module its first cell names. The core every lab shares:
``profile()`` (experiment sizes for this machine), ``devices`` (honest timing),
``meter`` (wait vs compute), ``launcher`` (real ranks), ``dsops`` (DeepSpeed op
cache), ``atomic`` (crash-safe writes) and ``plots`` (one style).
"""

from labkit.profiles import Profile, profile

__all__ = ["Profile", "profile"]
__version__ = "0.1.0"
