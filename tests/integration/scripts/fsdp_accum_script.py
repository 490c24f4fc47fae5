"""An HSDP (replicate x shard) FSDP2 script written the way people write them (issue 32, case 4).

LayerNorm + dropout residual blocks, each ``fully_shard``-ed, then the root; AdamW, a warm-up
``LambdaLR``, ``clip_grad_norm_`` over the DTensor gradients, ``--micro`` micro-batches per step
with ``set_requires_gradient_sync(False)`` on all but the last. Data:

* ``--data step``: every micro-batch a pure function of (step, micro, rank);
* ``--data loader``: a torchdata ``StatefulDataLoader`` over ``DistributedSampler(shuffle=True)``,
  tracked as ``job.track(loader=loader)``, its iterator made before the loop (``it = iter(loader)``)
  and again at each rollover; the epoch is left to unbroken (``--epoch-from unbroken``, the
  documented pattern) or set from a script variable (``--epoch-from counter``: the stock torch
  loop's ``sampler.set_epoch(epoch)``, which unbroken refuses).

``--micro-sleep-s S``: after the first micro-batch's backward rank 0 prints
``step <k> micro 0 done`` and every rank sleeps S, so a test can kill a rank while the
survivors hold an accumulated, not yet reduced gradient. Rank 0 writes the full weights to ``--out``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import unbroken

DIM, CLASSES, SAMPLES = 16, 4, 128


class Block(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm(x)))))


class Net(nn.Module):
    def __init__(self, blocks: int, dropout: float) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dropout) for _ in range(blocks))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--data", choices=("step", "loader"), default="step")
    p.add_argument("--epoch-from", choices=("unbroken", "counter"), default="unbroken")
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--per-rank-seed", action="store_true", help="dropout draws differ by rank")
    p.add_argument("--micro-sleep-s", type=float, default=0.0)
    p.add_argument("--out", required=True)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    job = unbroken.init()
    mesh = init_device_mesh("cpu", (2, job.world_size // 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    model = Net(args.blocks, args.dropout)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if args.per_rank_seed:
        torch.manual_seed(args.seed * 1000 + job.rank)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    warmup = 4
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    g = torch.Generator().manual_seed(args.seed)
    dataset = torch.utils.data.TensorDataset(torch.randn(SAMPLES, DIM, generator=g),
                                             torch.randint(CLASSES, (SAMPLES,), generator=g))
    loader = sampler = None
    if args.data == "loader":
        from torchdata.stateful_dataloader import StatefulDataLoader

        sampler = torch.utils.data.distributed.DistributedSampler(
            dataset, num_replicas=job.world_size, rank=job.rank, shuffle=True, seed=args.seed, drop_last=True)
        loader = StatefulDataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    job.track(model=model, optimizer=opt, scheduler=sched, loader=loader)  # loader=None is not tracked

    epoch = 0
    if sampler is not None:
        if args.epoch_from == "counter":
            sampler.set_epoch(epoch)
        it = iter(loader)

    def next_batch(step: int, micro: int):
        nonlocal epoch, it
        if loader is None:
            gen = torch.Generator().manual_seed(args.seed * 100_003 + step * 101 + micro * 7 + job.rank)
            return dataset[torch.randint(SAMPLES, (args.batch_size,), generator=gen)]
        try:
            return next(it)
        except StopIteration:  # a new epoch: a new shuffle
            epoch += 1
            if args.epoch_from == "counter":
                sampler.set_epoch(epoch)
            it = iter(loader)  # a tracked loader's sampler moves to the next epoch here
            return next(it)

    for step in job.steps(args.steps):
        with job.step():
            for micro in range(args.micro):
                model.set_requires_gradient_sync(micro == args.micro - 1)  # reduce on the last one only
                x, y = next_batch(step, micro)
                loss = F.cross_entropy(model(x), y) / args.micro
                loss.backward()
                if micro == 0 and args.micro_sleep_s:
                    if job.rank == 0:
                        print(f"step {step} micro 0 done", flush=True)
                    time.sleep(args.micro_sleep_s)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            if job.rank == 0:
                print(f"step {step}: loss {loss.item():.5f}", flush=True)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if job.rank == 0:
        save_file({k: v.detach().clone().contiguous() for k, v in full.items()}, args.out)
    job.close()


if __name__ == "__main__":
    main()
