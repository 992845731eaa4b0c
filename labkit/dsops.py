"""Build DeepSpeed's JIT-compiled ops once per environment, before ranks start.

DeepSpeed compiles C++ ops with gcc on first use (the CPU shared-memory comm op
about 1-2 minutes, cpu_adam 1-4 minutes). Left to the ranks, every rank waits on
the same file lock and a notebook cell looks hung; left in the shared default
cache, two virtual environments keep rebuilding each other's copy. So labkit
gives each environment its own ``TORCH_EXTENSIONS_DIR``, builds ops in one
process first, prints what the build cost, and clears a lock left behind by a
killed build (torch's lock is a bare file; a dead builder never removes it and
the next build waits forever).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from labkit.atomic import atomic_file

ENV_VAR = "TORCH_EXTENSIONS_DIR"
COMM_OP = "ShareMemCommBuilder"
CPU_ADAM_OP = "CPUAdamBuilder"
ASYNC_IO_OP = "AsyncIOBuilder"
QUANTIZER_OP = "QuantizerBuilder"  # ZeRO++ qwZ/qgZ kernels, CUDA only


def use_environment_extensions_dir() -> Path:
    """Point ``TORCH_EXTENSIONS_DIR`` into this environment unless the user set it, and use its ninja.

    torch runs whichever ``ninja`` is first on ``PATH``, and two ninja versions
    hash commands differently (pip's 1.13 and Debian's 1.11 here), so each reads
    the other's build log as "command line changed" and rebuilds every op: a
    run started from an activated venv and one started by the venv's python
    alone rebuilt async_io inside a timed ZeRO launch, which then timed out.
    The environment's own ninja, when it has one, goes first for this process
    and the ranks it starts.
    """
    default = Path(sys.prefix) / "torch_extensions"
    path = Path(os.environ.setdefault(ENV_VAR, str(default)))
    path.mkdir(parents=True, exist_ok=True)
    bin_dir = str(Path(sys.executable).parent)
    if (Path(bin_dir) / "ninja").exists() and os.environ.get("PATH", "").split(os.pathsep)[0] != bin_dir:
        os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
    return path


def cache_cpu_info() -> None:
    """Make py-cpuinfo's ``get_cpu_info`` answer from memory after its first call in this process, and
    from a file in the environment's ops folder (:func:`cpu_info_file`) for every later process on this CPU.

    DeepSpeed asks it every time it makes a CPU Adam (one per engine: five per rank in Lab 4) and
    when it checks an op, and each call probes the CPU again in a child process: 1.15 s on the
    2-core CI box, most of a Lab 4 rank's start-up. The CPU does not change while a process runs,
    nor between processes on one machine; the file is named for the CPU it describes, so a folder
    carried to another machine probes again there. Written atomically: a probe killed half-way
    leaves no file, and the next process probes again.
    """
    try:
        import cpuinfo
    except ImportError:  # no DeepSpeed, no py-cpuinfo: nothing asks
        return
    if hasattr(cpuinfo.get_cpu_info, "cache_info"):
        return
    probe = cpuinfo.get_cpu_info

    @functools.cache
    def get_cpu_info() -> dict:
        path = cpu_info_file()
        if path is not None:
            try:
                return json.loads(path.read_text())
            except (OSError, ValueError):
                pass
        info = probe()
        if path is not None:
            try:
                with atomic_file(path) as tmp:
                    tmp.write_text(json.dumps(info))
            except OSError:   # a read-only folder: the probe's answer still serves this process
                pass
        return info

    cpuinfo.get_cpu_info = get_cpu_info


_CPU_FIELDS = ("vendor_id", "cpu family", "model", "model name", "stepping", "flags", "isa", "cpu model",
               "CPU implementer", "CPU part", "Features")


def cpu_info_file() -> Path | None:
    """Where this CPU's py-cpuinfo answer is kept: the ops folder, named for the CPU (None without /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = sorted({line.strip() for line in f if line.split(":", 1)[0].strip() in _CPU_FIELDS})
    except OSError:
        return None
    key = hashlib.sha256("\n".join([*lines, str(os.cpu_count())]).encode()).hexdigest()[:16]
    folder = Path(os.environ.get(ENV_VAR) or Path(sys.prefix) / "torch_extensions")
    return folder / f"cpuinfo-{key}.json"


def lock_holders(lock_path: Path) -> list[int]:
    """PIDs that hold ``lock_path`` open (torch's builder keeps its lock's fd open)."""
    target = str(lock_path.resolve())
    holders = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd) == target:
                    holders.append(int(proc.name))
                    break
        except OSError:
            continue
    return holders


def is_stale(lock_exists: bool, holders: list[int]) -> bool:
    """A lock nobody holds open was left by a builder that died."""
    return lock_exists and not holders


def clear_stale_locks(extensions_dir: Path | None = None) -> list[Path]:
    """Remove build locks whose builder is gone; returns the removed paths."""
    root = extensions_dir or use_environment_extensions_dir()
    removed = []
    for lock in root.glob("**/lock"):
        if is_stale(lock.exists(), lock_holders(lock)):
            lock.unlink(missing_ok=True)
            removed.append(lock)
    return removed


def op_is_built(name: str, accelerator: str | None = None) -> bool:
    """Whether ``name``'s shared object is already in this environment's cache."""
    builder = _builder(name, accelerator)
    if builder is None:
        return True
    root = use_environment_extensions_dir()
    return any(root.glob(f"**/{builder.NAME}.so"))


def _builder(name: str, accelerator: str | None = None):  # -> deepspeed OpBuilder | None
    if accelerator not in (None, "cpu"):
        raise ValueError(f"accelerator must be None (DeepSpeed's choice) or 'cpu', got {accelerator!r}")
    if accelerator == "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        return CPU_Accelerator().create_op_builder(name)
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().create_op_builder(name)


def accelerator_for(backend: str) -> str | None:
    """The accelerator whose ops ranks of ``backend`` load: gloo ranks are CPU ranks."""
    return "cpu" if backend == "gloo" else None


def ranks_accelerator(backend: str | None = None):  # -> deepspeed's accelerator object
    """DeepSpeed's accelerator inside the ranks of ``backend`` (default: the profile's).

    Not necessarily this process's: on a GPU machine the parent's DeepSpeed picks
    CUDA, while gloo ranks run on the CPU (the launcher sets ``DS_ACCELERATOR=cpu``
    for them). A dtype or an op must be chosen for the ranks' accelerator.
    """
    from labkit import profile

    backend = backend or profile().backend
    if accelerator_for(backend) == "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        return CPU_Accelerator()
    from deepspeed.accelerator import get_accelerator

    return get_accelerator()


def ensure_built(
    names: tuple[str, ...] = (COMM_OP,), *, accelerator: str | None = None, verbose: bool = True,
    in_process: bool = False,
) -> dict[str, float]:
    """Build each op that is not built yet, before any rank needs it; returns seconds spent per op.

    ``accelerator="cpu"`` builds the ops CPU ranks load even on a GPU machine, where
    DeepSpeed's own choice would be CUDA's. Ops the accelerator does not have (the
    CPU comm op under CUDA) are skipped. The first build's cost is printed, not hidden.

    The build runs in a child process (``python -m labkit.dsops``) unless
    ``in_process``: DeepSpeed's compatibility probe for async_io compiles a test
    program with stderr redirected through its file descriptor, which a Jupyter
    kernel's stderr does not have, so in a notebook the probe says "not
    compatible" for an op that builds and loads fine in the ranks.
    """
    use_environment_extensions_dir()
    cache_cpu_info()
    for lock in clear_stale_locks():
        print(f"removed a stale DeepSpeed build lock left by a killed build: {lock}")
    seconds = {}
    for name in names:
        builder = _builder(name, accelerator)
        if builder is None:
            continue
        cached = op_is_built(name, accelerator)
        if verbose and not cached:
            print(f"building DeepSpeed op {builder.NAME} (once per environment, 1-4 min)...", flush=True)
        start = time.perf_counter()
        if in_process:
            builder.load(verbose=False)
        elif not cached:
            _build_in_child(name, accelerator)
        seconds[name] = time.perf_counter() - start
        if verbose and not cached:
            print(f"built {builder.NAME} in {seconds[name]:.0f} s into {os.environ[ENV_VAR]}")
    return seconds


def _build_in_child(name: str, accelerator: str | None) -> None:
    command = [sys.executable, "-m", "labkit.dsops", name] + (["--accelerator", accelerator] if accelerator else [])
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"building DeepSpeed op {name} failed ({' '.join(command)}); its output ends:\n"
                           f"{(done.stdout + done.stderr)[-3000:]}")


def main() -> int:
    """``python -m labkit.dsops [op ...] [--accelerator cpu]``: pre-build ops (CI and Binder call this)."""
    args = sys.argv[1:]
    accelerator = None
    if "--accelerator" in args:
        at = args.index("--accelerator")
        accelerator, args = args[at + 1], args[:at] + args[at + 2:]
    names = tuple(args) or (COMM_OP, CPU_ADAM_OP)
    spent = ensure_built(names, accelerator=accelerator, in_process=True)
    for name, secs in spent.items():
        print(f"{name}: ready ({secs:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
