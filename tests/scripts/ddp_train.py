"""A small DDP training script as a learner would write it, unmodified by labkit (``labkit diagnose`` runs it).

``python ddp_train.py [LOAD_MS] [SAVE_EVERY]``: each sample costs LOAD_MS of loading (a sleep in the dataset,
as a slow decode would); rank 0 saves a checkpoint every SAVE_EVERY steps (0: never). Runs under torchrun, or
alone as one rank.
"""

import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset


class SlowDataset(Dataset):
    def __init__(self, n: int, load_s: float):
        self.n, self.load_s = n, load_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if self.load_s:
            time.sleep(self.load_s)
        return torch.randn(256), i % 10


def main() -> None:
    load_s = float(sys.argv[1]) / 1e3 if len(sys.argv) > 1 else 0.0
    save_every = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    checkpoint = os.path.join(tempfile.gettempdir(), f"ddp-train-{os.getpid()}.pt")
    try:
        for step, (x, y) in enumerate(DataLoader(SlowDataset(1_000_000, load_s), batch_size=32)):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if save_every and step % save_every == save_every - 1 and (not distributed or dist.get_rank() == 0):
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint)
    finally:
        if os.path.exists(checkpoint):
            os.unlink(checkpoint)


if __name__ == "__main__":
    main()
