"""An unchanged torchrun DDP training script: no unbroken API, the default env:// rendezvous.

Trains a small model with stock DistributedDataParallel for ``--seconds`` of wall time (a
fixed number of steps, slowed down), then rank 0 prints the step count. Each step it writes
``<rank> <step>`` to ``--progress PATH.rank<r>`` so a test can see it train.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--seconds", type=float, required=True)
p.add_argument("--step-s", type=float, default=0.1)
p.add_argument("--progress", required=True)
args = p.parse_args()

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
steps = max(1, round(args.seconds / args.step_s))
for step in range(steps):
    x = torch.randn(4, 8)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    with open(f"{args.progress}.rank{rank}", "a") as f:
        f.write(f"{os.environ['TORCHELASTIC_RESTART_COUNT']} {step}\n")
    time.sleep(args.step_s)
if rank == 0:
    print(f"trained {steps} steps", flush=True)
dist.destroy_process_group()
