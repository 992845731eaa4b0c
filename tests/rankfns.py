"""Rank functions for launcher tests: importable, so spawned ranks can find them."""

import os
import time

import torch
import torch.distributed as dist


def allreduce_rank(value: float) -> dict:
    tensor = torch.tensor([value * (dist.get_rank() + 1)])
    dist.all_reduce(tensor)
    return {"rank": dist.get_rank(), "sum": tensor.item(), "threads": torch.get_num_threads()}


def failing_rank(bad_rank: int) -> int:
    if dist.get_rank() == bad_rank:
        raise ValueError(f"rank {bad_rank} was told to fail")
    dist.barrier()
    return dist.get_rank()


def hanging_rank(pid_dir: str) -> None:
    """Write this rank's pid, then hang (rank 0) or wait for it (the others).

    The pid file appears whole (written aside, then renamed): a test that polls for it read an empty
    file once, between the open and the write (CI rehearsal, 2026-12-04).
    """
    path = os.path.join(pid_dir, f"{dist.get_rank()}.pid")
    with open(path + ".tmp", "w") as handle:
        handle.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    if dist.get_rank() == 0:
        time.sleep(3600)
    dist.barrier()


def deepspeed_rank() -> str:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    tensor = torch.ones(4)
    deepspeed.comm.all_reduce(tensor)
    return f"{dist.get_world_size()}:{tensor.sum().item()}"


def deepspeed_accelerator_rank() -> tuple[str, str]:
    from deepspeed.accelerator import get_accelerator

    return os.environ.get("DS_ACCELERATOR", ""), get_accelerator().device_name()


def env_rank(name: str) -> tuple[str | None, str]:
    """This rank's value of ``name`` and its working folder."""
    return os.environ.get(name), os.getcwd()


def first_done_still_runs_rank(wait_s: float) -> bool | None:
    """Rank 0 returns at once; the last rank, ``wait_s`` later, says whether rank 0's process still runs."""
    from pathlib import Path

    pids = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    if dist.get_rank() != dist.get_world_size() - 1:
        return None
    time.sleep(wait_s)
    status = Path(f"/proc/{pids[0]}/status")
    return status.exists() and "\nState:\tZ" not in status.read_text()


def store_is_listening_rank() -> bool:
    """Whether the store at MASTER_ADDR:MASTER_PORT already listens, in a rank that started no group."""
    import socket

    with socket.socket() as sock:
        return sock.connect_ex((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))) == 0


def hand_buckets_rank(order: str) -> dict:
    """Hand-made buckets average the gradients like one all-reduce per tensor; returns when each bucket launched."""
    from labkit.ddp_overlap import HandBuckets
    from labkit.gradsync_workload import make_model

    model = make_model(16, 3)
    params = list(model.parameters())
    buckets = [[i] for i in reversed(range(len(params)))]
    if order == "forward":
        buckets.reverse()
    hand = HandBuckets(params, buckets)
    launched = []   # after each gradient: how many buckets were on their way (hooks run in registration order)
    for param in params:
        param.register_post_accumulate_grad_hook(lambda _p: launched.append(len(hand.launched)))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
    torch.nn.functional.mse_loss(model(x), x.flip(1)).backward()
    launched_while_backward = launched[-2]   # before the last gradient
    mine = [p.grad.clone() for p in params]
    hand.finish()
    for grad in mine:
        dist.all_reduce(grad)
        grad /= dist.get_world_size()
    return {"max_diff": max((p.grad - g).abs().max().item() for p, g in zip(params, mine)),
            "launched_while_backward": launched_while_backward, "buckets": len(buckets)}
