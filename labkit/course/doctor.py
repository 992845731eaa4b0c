"""What this machine offers for the labs, with the fix for each missing piece."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass

import torch

from labkit import dsops
from labkit.paths import data_dir
from labkit.profiles import ENV_VAR, PROFILE_NAMES, detect_profile_name, profile


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""


def checks() -> list[Check]:
    found = [_profile_check()]
    found.append(Check("torch", True, f"{torch.__version__}" + (f", CUDA {torch.version.cuda}" if torch.version.cuda else ", CPU build")))
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            found.append(Check(f"gpu {i}", True, f"{props.name}, {props.total_memory / 2**30:.0f} GiB"))
        nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else "unknown"
        found.append(Check("nccl", True, str(nccl)))
    else:
        found.append(Check("gpu", False, "none: labs run their CPU variants (profile 'ci')",
                           "nothing to fix; on a GPU machine install a CUDA build of torch"))
    found.append(_package("deepspeed", "pip install deepspeed"))
    found.append(_package("daft", "pip install 'daft>=0.7,<0.8'"))
    found.append(_package("ray", "pip install -e '.[distributed]' (optional: Lab 2's Ray runner)", optional=True))
    compiler = shutil.which("c++") or shutil.which("g++")
    found.append(Check("c++ compiler", bool(compiler), compiler or "missing",
                       "install gcc/g++ (DeepSpeed compiles its ops on first use)"))
    if importlib.util.find_spec("deepspeed"):
        found.append(Check("deepspeed accelerator", True, _deepspeed_accelerator()))
        for op in (dsops.COMM_OP, dsops.CPU_ADAM_OP):
            built = dsops.op_is_built(op)
            found.append(Check(f"deepspeed op {op}", built, "built" if built else "not built yet",
                               "labkit build-ops (1-4 min, once per environment)"))
    from labkit import fabric

    links = fabric.probe()
    found.append(Check("links between ranks", links.mode == "namespaces",
                       f"{links.mode}: {links.reason}",
                       "run as root on Linux for real shaped links (Labs 5, 6, 8); otherwise they emulate, and say so"))
    free_gib = shutil.disk_usage(data_dir()).free / 2**30
    found.append(Check("disk for data/", free_gib > 5, f"{free_gib:.0f} GiB free in {data_dir()}",
                       "free at least 5 GiB or set LABKIT_DATA elsewhere"))
    return found


def _profile_check() -> Check:
    """The profile every lab will use; a bad ``LABKIT_PROFILE`` is reported here, with the fix."""
    chosen = os.environ.get(ENV_VAR)
    try:
        active = profile()
    except (ValueError, RuntimeError) as exc:
        return Check("profile", False, f"{ENV_VAR}={chosen!r} cannot be used: {exc}",
                     f"unset {ENV_VAR} (this machine auto-detects {detect_profile_name()!r}) "
                     f"or set it to one of {', '.join(PROFILE_NAMES)}")
    if chosen:
        return Check("profile", True, f"{active.name!r} from {ENV_VAR} (auto-detection would pick "
                                      f"{detect_profile_name()!r})")
    return Check("profile", True, f"auto-detected {active.name!r} (override with {ENV_VAR})")


def _deepspeed_accelerator() -> str:
    """The device DeepSpeed will use, said once here instead of by DeepSpeed's own start-up warning.

    DeepSpeed resets its logger's level when it is imported, so a filter (which
    survives that) drops the one warning.
    """
    logging.getLogger("DeepSpeed").addFilter(
        lambda record: not record.getMessage().startswith("Setting accelerator to"))
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().device_name()
    return name + (" (DeepSpeed found no GPU, so its ops build and run for the CPU)" if name == "cpu" else "")


def _package(name: str, fix: str, *, optional: bool = False) -> Check:
    spec = importlib.util.find_spec(name)
    if spec is None:
        return Check(name, optional, "not installed" + (" (optional)" if optional else ""), fix)
    from importlib.metadata import version

    return Check(name, True, version(name))


def print_checks(found: list[Check]) -> None:
    for check in found:
        mark = "ok  " if check.ok else "WARN"
        print(f"[{mark}] {check.name}: {check.detail}" + (f"\n       fix: {check.fix}" if not check.ok and check.fix else ""))
