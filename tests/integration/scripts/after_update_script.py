"""Per-rank state a step changes *after* its optimizer update, the two ways scripts do it.

DDP over 2 ranks, a BatchNorm layer and dropout, each rank seeded differently after the model is
built (dropout masks differ by rank). Each step: forward, backward, a short sleep, ``opt.step()``,
then, by ``--variant``:

* ``draw``: a draw from the rank's own torch stream after the update (whether to log this step's
  loss: a sampled log line), so the next step's dropout masks depend on it;
* ``ema``: ``AveragedModel(model, use_buffers=True)`` updated after the step: it averages each
  rank's own BatchNorm statistics, so its buffers differ by rank.

A rank lost between its update and its next step's start has no capture of what the update
changed: recovering it from its state after compute would end exit 0 with other weights. Every rank
writes its model and, for ``ema``, the average to ``OUT.rank<r>.safetensors``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
from safetensors.torch import save_file
from torch.nn.parallel import DistributedDataParallel
from torch.optim.swa_utils import AveragedModel

import unbroken

DIM, HIDDEN, BATCH = 8, 16, 8


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variant", choices=("draw", "ema"), required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    job = unbroken.init()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.ReLU(), nn.Dropout(0.3),
                        nn.Linear(HIDDEN, 1))
    model = DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    torch.manual_seed(1000 + job.rank)  # dropout and the jitter differ by rank
    objects = {"model": model, "optimizer": opt}
    ema = None
    if args.variant == "ema":
        ema = objects["ema"] = AveragedModel(net, use_buffers=True)
    job.track(**objects)
    for step in job.steps(args.steps):
        with job.step():
            g = torch.Generator().manual_seed(job.rank * 7919 + step)
            x = torch.randn(BATCH, DIM, generator=g)
            loss = (model(x) - x[:, :1]).square().mean()
            loss.backward()
            time.sleep(0.03)
            opt.step()
            opt.zero_grad()
            if args.variant == "draw":
                if torch.rand(()).item() < 0.2:
                    print(f"[rank {job.rank}] sampled: step {step} loss {loss.item():.4f}", flush=True)
            else:
                ema.update_parameters(net)
    state = {f"model.{k}": v.detach().clone() for k, v in net.state_dict().items()}
    if ema is not None:
        state.update({f"ema.{k}": v.detach().clone() for k, v in ema.state_dict().items()})
    save_file(state, f"{args.out}.rank{job.rank}.safetensors")
    job.close()


if __name__ == "__main__":
    main()
