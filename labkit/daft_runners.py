"""The same Daft pipeline on each of Daft's runners: native threads, or a Ray cluster.

Daft fixes a process's runner on first use, so :func:`compare_runners` runs each in
a fresh ``python -m labkit.daft_runners`` and compares checksums and times. Ray is
left out, with the reason, only when it is not installed or ``LABKIT_SKIP_RAY`` is
set; a Ray that is installed and fails is an error a learner should see. A local Ray
keeps its session (logs, sockets, spilled objects) in a temporary folder that is
removed when its runner ends, however it ends: by default Ray leaves every session
in ``/tmp/ray`` for good.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import daft

from labkit import processes
from labkit.catalog import CatalogError, catalog_path, read_catalog
from labkit.dataengine import check_positive, decode_pipeline, use_native_runner

RUNNERS = ("native", "ray")
SKIP_RAY_ENV = "LABKIT_SKIP_RAY"
RAY_START_TIMEOUT = "The current node timed out during startup"


@dataclass(frozen=True)
class RunnerResult:
    """One runner's pass over the same pipeline, from its own subprocess."""

    runner: str
    images: int = 0
    label_sum: int = 0
    pixel_sum: int = 0
    pipeline_s: float = 0.0
    process_s: float = 0.0
    skipped: str | None = None

    @property
    def images_per_s(self) -> float:
        return self.images / self.pipeline_s if self.pipeline_s else 0.0


def ray_unavailable_reason() -> str | None:
    """Why the Ray runner cannot run here, or None when it can."""
    if os.environ.get(SKIP_RAY_ENV):
        return f"{SKIP_RAY_ENV} is set (ray.init costs tens of seconds on a small machine)"
    if importlib.util.find_spec("ray") is None:
        return "Ray is not installed; pip install 'labkit[distributed]' (ray[data]>=2.40,<2.60)"
    return None


def run_pipeline(
    catalog: str | Path, *, runner: str, image_px: int, limit: int,
    ray_address: str | None = None, num_threads: int | None = None, ray_temp_dir: str | None = None,
) -> RunnerResult:
    """Set the runner for this process, run the decode pipeline over ``limit`` rows, checksum it.

    Call once per process: Daft fixes the runner on first use. ``ray_temp_dir`` is where a
    local Ray keeps its session (Ray's default: ``/tmp/ray``).
    """
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}")
    check_positive(image_px=image_px, limit=limit)
    catalog_path(catalog)
    if runner == "ray":
        if ray_address is None:
            import ray

            # A local Ray without its dashboard starts faster; Daft reuses an initialised Ray.
            ray.init(include_dashboard=False, log_to_driver=False, num_cpus=num_threads, _temp_dir=ray_temp_dir)
        daft.set_runner_ray(address=ray_address)
    else:
        use_native_runner(num_threads)
    start = time.perf_counter()
    frame = decode_pipeline(read_catalog(catalog).sort("image_id").limit(limit), image_px)
    images = label_sum = pixel_sum = 0
    for record_batch in frame.to_arrow_iter():
        pixels = record_batch.column("image").to_numpy_ndarray()
        images += record_batch.num_rows
        label_sum += int(record_batch.column("label").to_numpy().sum())
        pixel_sum += int(pixels.sum(dtype="int64"))
    return RunnerResult(
        runner=runner, images=images, label_sum=label_sum, pixel_sum=pixel_sum,
        pipeline_s=time.perf_counter() - start,
    )


def _run_runner(command: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """Run one runner's subprocess in its own session; past ``timeout_s`` stop its whole group and raise."""
    env = {**os.environ, "DAFT_ANALYTICS_ENABLED": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          start_new_session=True) as child:
        try:
            stdout, stderr = child.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            processes.kill_group(child.pid)
            child.communicate()
            raise RuntimeError(f"{' '.join(command[2:])} did not finish within {timeout_s:.0f} s; stopped it and "
                               f"every process it started") from None
        except BaseException:   # an interrupted cell: stop the runner and its Ray node too
            processes.kill_group(child.pid)
            child.communicate()
            raise
    return subprocess.CompletedProcess(command, child.returncode, stdout, stderr)


def compare_runners(
    catalog: str | Path, *, image_px: int, limit: int, runners: Sequence[str] = RUNNERS,
    ray_address: str | None = None, timeout_s: float = 300.0,
) -> list[RunnerResult]:
    """Run the same pipeline once per runner, each in a fresh ``python -m labkit.daft_runners``.

    Ray is skipped, with the reason, only when it is not installed or ``LABKIT_SKIP_RAY``
    is set. A Ray that is installed and does not start or finish in time is a
    failure, raised with its error output: a skip would hide exactly the problem a
    learner needs to see. Each runner runs in its own session, and a runner that
    overruns is stopped with every process it started (Ray's node among them).
    """
    results = []
    for runner in runners:
        if runner not in RUNNERS:
            raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}")
        reason = ray_unavailable_reason() if runner == "ray" else None
        if reason:
            results.append(RunnerResult(runner=runner, skipped=reason))
            continue
        command = [
            sys.executable, "-m", "labkit.daft_runners", "--catalog", str(catalog),
            "--runner", runner, "--image-px", str(image_px), "--limit", str(limit),
        ]
        if ray_address:
            command += ["--ray-address", ray_address]
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="labkit-ray-", ignore_cleanup_errors=True) as session:
            local_ray = runner == "ray" and not ray_address
            done = _run_runner(command + (["--ray-temp-dir", session] if local_ray else []), timeout_s)
        if done.returncode != 0:
            hint = (f" A local Ray node did not start in time; on a busy machine retry, or set {SKIP_RAY_ENV}=1 "
                    "to leave Ray out on purpose." if RAY_START_TIMEOUT in done.stderr else "")
            raise RuntimeError(f"runner {runner!r} failed (exit {done.returncode}).{hint}\n{done.stderr[-3000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        results.append(RunnerResult(**{**result, "process_s": time.perf_counter() - start}))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m labkit.daft_runners",
        description="Run the decode pipeline on one Daft runner and print a JSON result line.",
    )
    parser.add_argument("--catalog", required=True, help="path to catalog.parquet")
    parser.add_argument("--runner", choices=RUNNERS, default="native")
    parser.add_argument("--image-px", type=int, default=32)
    parser.add_argument("--limit", type=int, default=512)
    parser.add_argument("--num-threads", type=int, default=None, help="native runner threads")
    parser.add_argument(
        "--ray-address", default=os.environ.get("RAY_ADDRESS"),
        help="an existing Ray cluster (ray://host:10001); default starts a local one",
    )
    parser.add_argument("--ray-temp-dir", default=None, help="where a local Ray keeps its session (default /tmp/ray)")
    args = parser.parse_args(argv)
    try:
        result = run_pipeline(
            args.catalog, runner=args.runner, image_px=args.image_px, limit=args.limit,
            ray_address=args.ray_address, num_threads=args.num_threads, ray_temp_dir=args.ray_temp_dir,
        )
    except (CatalogError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(result)))
    return 0


if __name__ == "__main__":
    status = main()
    if daft.get_or_infer_runner_type() == "native":
        # Daft's native threads can abort a finalizing interpreter (1 of 30 runs beside a busy
        # process here, and one CI run). The Ray runner keeps the normal exit: Ray's exit hook
        # stops the local cluster it started.
        processes.exit_without_finalizing(status)
    raise SystemExit(status)
