"""Mixed precision the way torch documents it: bf16 autocast and a tracked ``GradScaler``.

DDP over 2 ranks, AdamW, a tracked cursor; each step: forward under ``torch.autocast("cpu",
dtype=torch.bfloat16)``, ``scaler.scale(loss).backward()``, a short sleep (a fault lands after the
backward), ``scaler.step(opt)``, ``scaler.update()``. ``--init-scale`` 1024 trains normally; 2**127
makes the scaled gradients overflow so that the scaler skips steps and backs its scale off (the
scaler's own handling of non-finite gradients). Every rank writes its module state and the
scaler's scale to ``--out`` (``OUT.rank<r>.safetensors``).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
from safetensors.torch import save_file
from torch.nn.parallel import DistributedDataParallel

import unbroken

DIM, HIDDEN, BATCH = 12, 32, 8


class Cursor:
    """This rank's stream of batches: the batch of position p is a pure function of (rank, p)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.position = rank, 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.rank * 10_007 + self.position)
        self.position += 1
        x = torch.randn(BATCH, DIM, generator=g)
        return x, x[:, :1] * 2 - x[:, 1:2]

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--init-scale", type=float, default=1024.0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    job = unbroken.init()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=args.init_scale, growth_interval=2)
    cursor = Cursor(job.rank)
    job.track(model=model, optimizer=opt, scaler=scaler, cursor=cursor)
    for step in job.steps(args.steps):
        with job.step():
            x, y = cursor.next_batch()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            scaler.scale((out.float() - y).square().mean()).backward()
            time.sleep(0.03)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        print(f"[rank {job.rank}] step {step} done", flush=True)
    state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    state["scaler.scale"] = torch.tensor(float(scaler.get_scale()))
    save_file(state, f"{args.out}.rank{job.rank}.safetensors")
    job.close()


if __name__ == "__main__":
    main()
