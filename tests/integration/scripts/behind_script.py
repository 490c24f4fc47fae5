"""A manual data-parallel loop whose rank ``--slow-rank`` is slow to wait for one step's reduction.

Each step: forward with dropout (each rank's own stream), backward, the gradients flattened and
all-reduced with ``dist.all_reduce(async_op=True)`` on the default group, a sleep of ``--slow-s``
on rank ``--slow-rank`` at step ``--slow-step`` between issuing the reduction and waiting for it,
the average, ``opt.step()`` (Adam). With ``--draw-in-sync`` every rank draws from its own stream
between issuing the reduction and waiting for it (its state then moves inside the reduction).

A rank killed as it enters that step's update (its reduction done) leaves a survivor that made the
update and the slow rank, whose reduction completed too but which sees the abort order before it
waits: it is cut inside the reduction and is behind by one update (worker/commit.py). Every rank
writes its model to ``OUT.rank<r>.safetensors``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors.torch import save_file

import unbroken

DIM, HIDDEN, BATCH = 8, 16, 8


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--slow-rank", type=int, default=1)
    p.add_argument("--slow-step", type=int, default=5)
    p.add_argument("--slow-s", type=float, default=1.5)
    p.add_argument("--draw-in-sync", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    job = unbroken.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Dropout(0.3), nn.Linear(HIDDEN, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(1000 + job.rank)  # data and dropout differ by rank
    job.track(model=model, optimizer=opt)
    params = list(model.parameters())
    for step in job.steps(args.steps):
        with job.step():
            x = torch.randn(BATCH, DIM)
            loss = (model(x) - x[:, :1]).square().mean()
            loss.backward()
            flat = torch.cat([q.grad.reshape(-1) for q in params])
            work = dist.all_reduce(flat, async_op=True)
            if args.draw_in_sync:
                torch.rand(())
            if job.rank == args.slow_rank and step == args.slow_step:
                time.sleep(args.slow_s)
            work.wait()
            flat /= job.world_size
            offset = 0
            for q in params:
                q.grad.copy_(flat[offset:offset + q.numel()].view_as(q))
                offset += q.numel()
            opt.step()
            opt.zero_grad()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state["rng"] = torch.get_rng_state()  # the rank's own stream: resumed from its own state
    save_file(state, f"{args.out}.rank{job.rank}.safetensors")
    job.close()


if __name__ == "__main__":
    main()
