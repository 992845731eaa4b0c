"""Whether DeepSpeed's NVMe offload can really run here, and where its files go.

Offloading "to NVMe" in a RAM filesystem copies RAM to RAM and would be reported
as disk, and DeepSpeed's async_io op takes minutes to build: :func:`nvme_available`
says, cheapest check first, whether the probe may include the NVMe configuration,
and if not, why (the reason the notebook prints).
"""

from __future__ import annotations

import os
import tempfile

RAM_FILESYSTEMS = ("tmpfs", "ramfs")


NVME_DIR_ENV = "LABKIT_NVME_DIR"


def nvme_parent_dir() -> str:
    """Where NVMe offload files go: ``$LABKIT_NVME_DIR``, else the temp folder."""
    return os.environ.get(NVME_DIR_ENV) or tempfile.gettempdir()


def filesystem_type(path: str, mounts_text: str | None = None) -> str:
    """The type of the filesystem holding ``path`` (``"ext4"``, ``"tmpfs"``, ...), from ``/proc/mounts``.

    The mount point that is the longest prefix of the resolved path wins; of equal
    ones the last listed (a later mount hides an earlier one). ``"unknown"`` if none.
    """
    if mounts_text is None:
        try:
            with open("/proc/mounts") as handle:
                mounts_text = handle.read()
        except OSError:
            return "unknown"
    real = os.path.realpath(path)
    best, fstype = "", "unknown"
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = fields[1].replace("\\040", " ")
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, fstype = mount, fields[2]
    return fstype


def nvme_available(profile_name: str | None = None, *, backend: str | None = None,
                   nvme_dir: str | None = None) -> tuple[bool, str]:
    """Whether NVMe offload runs here, and if not, why (the reason the notebook prints).

    Checked in order, cheapest first, so that the 4-8 minute build of DeepSpeed's
    async_io op is never started where its result could not be used:

    * the offload folder (``nvme_dir``, else :func:`nvme_parent_dir`) must not be
      on a RAM filesystem: "offloading to NVMe" in a tmpfs ``/tmp`` copies RAM to
      RAM and would be reported as disk;
    * the ranks' accelerator (gloo ranks: the CPU's) must have an async_io op;
    * a built op is used; otherwise the ci profile skips (the build does not fit
      its budget) and the GPU profiles build it only if the builder says it can
      (libaio-dev present).
    """
    from labkit import dsops, profile

    directory = nvme_dir or nvme_parent_dir()
    fstype = filesystem_type(directory)
    if fstype in RAM_FILESYSTEMS:
        return False, (f"NVMe offload skipped: {directory} is on {fstype}, which lives in RAM, so offloading "
                       f"there would time RAM copies, not a disk; set {NVME_DIR_ENV} to a folder on an NVMe "
                       f"(or at least a real) disk")
    builder = dsops.ranks_accelerator(backend).create_op_builder(dsops.ASYNC_IO_OP)
    if builder is None:
        return False, "NVMe offload skipped: the ranks' accelerator has no DeepSpeed async_io op"
    ops_accelerator = dsops.accelerator_for(backend or profile().backend)
    if dsops.op_is_built(dsops.ASYNC_IO_OP, ops_accelerator):
        return True, f"async_io op is built; offload files go to {directory} ({fstype})"
    if (profile_name or profile().name) == "ci":
        return False, ("NVMe offload skipped in the ci profile: DeepSpeed's async_io op is not built, and "
                       "it needs libaio-dev plus a 4-8 min build that does not fit the budget (run "
                       "`python -m labkit.dsops AsyncIOBuilder` once to enable it)")
    if not builder.is_compatible(verbose=False):
        return False, ("NVMe offload skipped: DeepSpeed's async_io op cannot be built here "
                       "(install libaio-dev, then run `python -m labkit.dsops AsyncIOBuilder`)")
    return True, (f"async_io op will be built (once per environment, 4-8 min); offload files go to "
                  f"{directory} ({fstype})")
