"""``labkit diagnose``: run a training script on N ranks under the profiler, then say what the steps waited on.

The ranks are started by ``torchrun`` (loopback rendezvous, no restarts), so the
script sees exactly the environment it gets on a cluster (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT); each rank runs ``python -m
labkit.diagnose`` around it and writes its trace and shares. This module merges
the ranks, names the dominant bottleneck and the lab that treats it, and writes
``diagnosis.json`` and a stacked-bar figure. The whole launch is one process
group, killed on a timeout or an error, so no rank outlives the command.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from labkit.step_attribution import CATEGORIES

LESSONS: dict[str, tuple[str, str]] = {
    "data": ("Lab 1 (input pipeline), then Lab 2 (data engine)",
             "cache the decoded, transformed tensors or give the loader more workers; first check the loop "
             "is fast on data already in memory"),
    "host_to_device": ("Lab 3 (memory movement)",
                       "pin host memory and copy with non_blocking=True so copies overlap compute"),
    "compute": ("Lab 3 (memory movement)",
                "the device is doing the work: fuse memory-bound ops; more devices pay only while "
                "communication stays small (Lab 5)"),
    "communication": ("Lab 5 (gradient synchronisation), then Lab 6 (quantized collectives)",
                      "accumulate more micro-batches between syncs (DDP's no_sync) and let DDP's buckets "
                      "overlap the backward pass"),
    "checkpoint": ("Lab 7 (checkpoints)", "save asynchronously: snapshot to host memory, write in the background"),
    "other": ("Lab 3 (memory movement)",
              "time between ops, where the device waits for the host (Python, framework, launches): larger "
              "batches, fewer small ops, or torch.compile"),
}


@dataclass(frozen=True)
class Verdict:
    bottleneck: str
    share: float
    lab: str
    first_fix: str


def verdict(shares: dict[str, float]) -> Verdict:
    """The category that took the largest share of step time, and where the course treats it."""
    missing = set(CATEGORIES) - set(shares)
    if missing:
        raise ValueError(f"shares must name every category, missing {sorted(missing)}")
    top = max(CATEGORIES, key=lambda c: shares[c])
    return Verdict(top, shares[top], *LESSONS[top])


def check_nproc(nproc: int) -> None:
    """At most one rank per core (CPU) or per GPU: more would measure contention, not the job."""
    import torch

    limit = torch.cuda.device_count() if torch.cuda.is_available() else (os.cpu_count() or 1)
    what = "GPUs" if torch.cuda.is_available() else "CPU cores"
    if not 1 <= nproc <= limit:
        raise ValueError(f"--nproc must be in 1..{limit} (this machine's {what}), got {nproc}")


def launch(script: Path, args: list[str], *, out: Path, nproc: int = 1, steps: int = 10, warmup: int = 2,
           timeout_s: float = 300.0, link_gbit: float | None = None) -> list[dict]:
    """Run ``script`` on ``nproc`` ranks under the profiler; each rank's result, or a ValueError naming the fix.

    With ``link_gbit`` each rank gets a node of its own on a :class:`labkit.fabric.Fabric` whose links are
    shaped to that rate, and one ``torchrun`` per node starts it there (``--nnodes N --node-rank i``), as on
    a cluster: the script's collectives cross the shaped links.
    """
    if not script.is_file():
        raise ValueError(f"SCRIPT {script} is not a file; give the path of your training script")
    check_nproc(nproc)
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if link_gbit is not None:
        _check_link(link_gbit, nproc)
    from labkit.diagnose import ridge_of_this_machine

    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("rank*.json"):
        old.unlink()
    profiled = ["--module", "labkit.diagnose", "--steps", str(steps), "--warmup", str(warmup),
                "--ridge", f"{ridge_of_this_machine():.6g}", "--out", str(out), str(script), *args]
    log = out / "ranks.log"
    with open(log, "w") as handle, contextlib.ExitStack() as stack:
        if link_gbit is None:
            commands = [_torchrun(nproc, 1, 0, "127.0.0.1", out / "rank-logs") + profiled]
            envs = [{}]
        else:
            from labkit import fabric
            from labkit.topology import Topology, gbit_to_bytes_per_s

            fab = stack.enter_context(fabric.Fabric(Topology(nodes=nproc,
                                                             inter_node_bytes_per_s=gbit_to_bytes_per_s(link_gbit))))
            commands = [["ip", "netns", "exec", node.netns, *_torchrun(1, nproc, node.index, fab.nodes[0].address,
                                                                        out / "rank-logs" / f"node{node.index}")]
                        + profiled for node in fab.nodes]
            envs = [{"GLOO_SOCKET_IFNAME": fabric.UPLINK}] * nproc
        procs = [subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
                                  env=os.environ | {"PYTHONUNBUFFERED": "1"} | env)
                 for command, env in zip(commands, envs)]
        try:
            codes = _wait_all(procs, timeout_s)
        except subprocess.TimeoutExpired:
            raise ValueError(f"{script} did not finish {steps + warmup} profiled optimizer steps in "
                             f"{timeout_s:g} s; does it call optimizer.step()? Raise --timeout or lower --steps. "
                             f"Its output: {log}") from None
        finally:
            for proc in procs:
                _kill(proc)
    found = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    if any(codes) or len(found) != nproc:
        where, tail = _first_failure(out / "rank-logs", log)
        raise ValueError(f"{script} failed on its ranks (exit {max(codes, key=abs)}); the end of {where}:\n{tail}")
    return found


def _check_link(link_gbit: float, nproc: int) -> None:
    """A shaped link needs a rate, two ranks or more, and a machine where labkit can build namespaces."""
    from labkit import fabric

    if not link_gbit > 0:
        raise ValueError(f"--link-gbit must be a rate > 0 in Gbit/s, got {link_gbit}")
    if nproc < 2:
        raise ValueError(f"--link-gbit needs --nproc 2 or more (one rank per node), got {nproc}")
    capability = fabric.probe()
    if capability.mode != "namespaces":
        raise ValueError(f"--link-gbit needs real shaped links, and here: {capability.reason}")


def _torchrun(nproc_per_node: int, nnodes: int, node_rank: int, master_addr: str, log_dir: Path) -> list[str]:
    """torchrun's command line: on one node ``--standalone``, whose agent binds a free port itself and keeps
    it (two diagnoses at once never meet in one store); across a fabric's nodes, rank 0's node hosts it."""
    from labkit.fabric import MASTER_PORT

    rendezvous = (["--standalone"] if nnodes == 1 else
                  ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--master-addr", master_addr,
                   "--master-port", str(MASTER_PORT)])
    return [sys.executable, "-m", "torch.distributed.run", *rendezvous, "--nproc-per-node", str(nproc_per_node),
            "--max-restarts", "0", "--log-dir", str(log_dir), "--redirects", "3"]


def _wait_all(procs: list[subprocess.Popen], timeout_s: float) -> list[int]:
    """Every process's exit code, or as soon as one fails (its peers would wait for it until the timeout);
    ``TimeoutExpired`` once ``timeout_s`` have passed. A process still running when another failed gets -1."""
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [proc.poll() for proc in procs]
        if all(code is not None for code in codes) or any(code for code in codes):
            return [-1 if code is None else code for code in codes]
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(procs[0].args, timeout_s)
        time.sleep(0.05)


def _first_failure(rank_logs: Path, agent_log: Path) -> tuple[Path, str]:
    """The traceback a rank printed (its own stderr), else the end of torchrun's output."""
    for stderr in sorted(rank_logs.rglob("stderr.log")):
        text = stderr.read_text(errors="replace")
        if "Traceback" in text:
            return stderr, "\n".join(text[text.index("Traceback"):].splitlines()[-25:])
    return agent_log, "\n".join(agent_log.read_text(errors="replace").splitlines()[-25:])


def _kill(proc: subprocess.Popen) -> None:
    """The launch's whole group: torchrun, its ranks and whatever they started (loader workers)."""
    from labkit.processes import kill_group

    kill_group(proc.pid, grace_s=5.0)
    proc.wait()


def summarise(ranks: list[dict]) -> dict:
    """Shares per rank and averaged (weighted by step time), the verdict, the slowest rank and the spread."""
    if not ranks:
        raise ValueError("no rank results to summarise")
    total = sum(r["step_ms"] for r in ranks)
    mean = {c: sum(r["shares"][c] * r["step_ms"] for r in ranks) / total for c in CATEGORIES}
    steps = [r["step_ms"] for r in ranks]
    slowest = max(ranks, key=lambda r: r["step_ms"])
    found = verdict(mean)
    return {"world_size": len(ranks), "shares": mean, "verdict": found.__dict__,
            "step_ms": total / len(ranks), "slowest_rank": slowest["rank"],
            "step_spread": max(steps) / min(steps),
            "overhead": sum(r["step_ms"] / r["unprofiled_step_ms"] for r in ranks) / len(ranks),
            "memory_bound_share_of_compute": _mean_or_none([r["memory_bound_share_of_compute"] for r in ranks]),
            "ranks": ranks}


def _mean_or_none(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else sum(values) / len(values)


def table(summary: dict) -> str:
    head = f"{'rank':>6} {'step ms':>8} " + " ".join(f"{c:>14}" for c in CATEGORIES)
    rows = [f"{r['rank']:>6} {r['step_ms']:>8.1f} " + " ".join(f"{r['shares'][c]:>14.0%}" for c in CATEGORIES)
            for r in summary["ranks"]]
    rows.append(f"{'all':>6} {summary['step_ms']:>8.1f} " + " ".join(f"{summary['shares'][c]:>14.0%}"
                                                                   for c in CATEGORIES))
    v = summary["verdict"]
    bound = summary["memory_bound_share_of_compute"]
    bound_text = "not split (GPU kernels carry no FLOP counts)" if bound is None else f"{bound:.0%}"
    return "\n".join([head, *rows, "",
                      f"Verdict: {v['bottleneck']} takes {v['share']:.0%} of each step. See {v['lab']}.",
                      f"First fix to try: {v['first_fix']}.",
                      f"Compute in memory-bound ops (by this machine's ridge): {bound_text}. Slowest rank {summary['slowest_rank']}, "
                      f"step spread across ranks {summary['step_spread']:.2f}x. Profiler overhead: steps ran "
                      f"{summary['overhead']:.2f}x their unprofiled time."])


def stacked_shares(ax, labels: list[str], rows: list[dict[str, float]]) -> None:
    """One horizontal bar per row, its categories stacked in :data:`CATEGORIES` order, in % of step time."""
    left = [0.0] * len(rows)
    for category in CATEGORIES:
        widths = [100 * row[category] for row in rows]
        ax.barh(labels, widths, left=left, label=category)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_xlabel("share of step time (%), measured")
    ax.set_xlim(0, 100)
    ax.legend(ncol=3, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.25))


def write(summary: dict, out: Path) -> tuple[Path, Path]:
    """``diagnosis.json`` and ``diagnosis.png`` (one stacked bar per rank, and their average)."""
    from labkit import plots

    json_path = out / "diagnosis.json"
    json_path.write_text(json.dumps(summary, indent=1))
    fig, (ax,) = plots.figure(width=7.5, height=3.2)
    labels = [f"rank {r['rank']}" for r in summary["ranks"]] + ["all"]
    stacked_shares(ax, labels, [r["shares"] for r in summary["ranks"]] + [summary["shares"]])
    png_path = out / "diagnosis.png"
    fig.savefig(png_path, dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return json_path, png_path
