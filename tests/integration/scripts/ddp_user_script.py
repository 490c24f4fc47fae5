"""A stock DDP script written the way a new user writes it (issue 32, cases 1 and 2).

``nn.Sequential(Linear, BatchNorm1d, ReLU, Linear)`` under ``DistributedDataParallel``, AdamW,
``CosineAnnealingLR``, and a tracked cursor object (its own ``state_dict``/``load_state_dict``)
that advances inside each step. No sleep unless ``--step-sleep-s``.

``--group``: the process group DDP is built on: ``default`` (``DDP(net)``), ``job``
(``process_group=job.process_group``, as the README passes it to ``ShardedOptimizer``) or ``new``
(``process_group=dist.new_group()`` after ``unbroken.init()``).

Each completed step prints ``[rank <r>] step <s> done`` (a test sends its fault from outside at a
step boundary it sees there). At the end rank 0 writes the module's state (weights and BatchNorm
buffers) to ``--out``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.nn.parallel import DistributedDataParallel

import unbroken

DIM, HIDDEN, BATCH = 12, 64, 8


class Cursor:
    """Where this rank is in its stream of batches: the batch of position p is a pure function of
    (seed, rank, p). ``next_batch()`` advances the position: state changed inside a step."""

    def __init__(self, seed: int, rank: int) -> None:
        self.seed, self.rank, self.position = seed, rank, 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.rank * 10_007 + self.position)
        self.position += 1
        x = torch.randn(BATCH, DIM, generator=g)
        return x, x[:, :1] * 2 - x[:, 1:2]

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--group", choices=("default", "job", "new"), default="default")
    p.add_argument("--track", choices=("ddp", "module", "none"), default="ddp",
                   help="what job.track(model=...) gets: the DDP wrapper, the module inside it, or nothing")
    p.add_argument("--step-sleep-s", type=float, default=0.0)
    p.add_argument("--out", required=True)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    job = unbroken.init()
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    net = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))
    if args.group == "job":
        model = DistributedDataParallel(net, process_group=job.process_group)
    elif args.group == "new":
        model = DistributedDataParallel(net, process_group=dist.new_group())
    else:
        model = DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    cursor = Cursor(args.seed, job.rank)
    tracked = {"ddp": model, "module": net, "none": None}[args.track]
    job.track(model=tracked, optimizer=opt, scheduler=sched, cursor=cursor)  # model=None: not tracked
    for step in job.steps(args.steps):
        with job.step():
            x, y = cursor.next_batch()
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            if args.step_sleep_s:
                time.sleep(args.step_sleep_s)
            print(f"[rank {job.rank}] step {step} done loss {loss.item():.6f}", flush=True)
    if job.rank == 0:
        save_file({k: v.detach().clone().contiguous() for k, v in net.state_dict().items()}, args.out)
    job.close()


if __name__ == "__main__":
    main()
