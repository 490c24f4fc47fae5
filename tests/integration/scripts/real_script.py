"""A training script written the way people write them, for the real-scripts tests.

Unlike examples/train_gpt.py, whose batch is a pure function of the step and whose ranks
all seed the same, this script has state that changes inside a step and state that
differs by rank:

* ``--data sampler``: a tracked sampler whose ``next()`` advances its position at the start
  of every step (an iterator over a per-rank shard of a shuffled permutation, new per epoch);
* ``--data loader``: torchdata's ``StatefulDataLoader`` over a ``DistributedSampler`` with
  ``set_epoch`` (``--num-workers 0`` or ``2``), its iterator advanced inside the step, inside the
  script's own wrapper object (``LoaderSource``); ``--augment``: each sample gets noise and a
  random sign flip drawn from torch's and Python's global streams where it is fetched (in the
  loader's worker processes);
* ``--per-rank-seed``: ``torch.manual_seed(seed + rank)`` after the model is built, and
  dropout in the model, so every rank draws a different random stream each step;
* ``--optimizer plain|sharded``: AdamW after ``job.all_reduce`` of the gradients (the manual
  path, with or without ``--phases``), or ``unbroken.optim.ShardedOptimizer``;
* ``--wrapper ddp``: stock ``DistributedDataParallel(model)`` on the default group (recovered in
  flight); ``--wrapper ddp-own-group``: on a gloo group the script builds itself (``new_group``:
  not in-flight recoverable, a job restart); ``--batchnorm``: a BatchNorm layer in the model
  (running statistics, broadcast from rank 0 by DDP each forward); ``--find-unused``: DDP's
  ``find_unused_parameters=True`` with a layer the forward uses on every third step only;
  ``--static-graph``: DDP's ``static_graph=True``;
* ``--data step``: the batch is a pure function of (step, rank), nothing advances inside a step;
* ``--log PATH``: post-step code, appending ``<step>`` to ``PATH.rank<r>`` at the end of the
  ``with job.step():`` block and to ``PATH.after.rank<r>`` after it when ``job.step_completed``.

At the end every rank writes ``<out>.rank<r>.json``: digests of its RNG streams and its data
position, so a test can check each rank's own state, not only the weights (rank 0 writes the
weights to ``<out>``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

import unbroken

DIM, CLASSES, SAMPLES = 16, 4, 256


class ShardSampler:
    """Indices of this rank's shard of a shuffled permutation, one epoch after another.

    State: ``epoch`` and ``position`` (the next index inside the epoch's shard). ``next()``
    advances the position: tracked state that changes inside a step.
    """

    def __init__(self, num_samples: int, rank: int, world_size: int, seed: int) -> None:
        self.num_samples, self.rank, self.world_size, self.seed = num_samples, rank, world_size, seed
        self.epoch, self.position = 0, 0
        self._shard = self._build_shard()

    def _build_shard(self) -> list[int]:
        order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        return order[self.rank::self.world_size].tolist()

    def take(self, count: int) -> list[int]:
        out = []
        for _ in range(count):
            if self.position == len(self._shard):
                self.epoch, self.position = self.epoch + 1, 0
                self._shard = self._build_shard()
            out.append(self._shard[self.position])
            self.position += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._shard = self._build_shard()


class Net(nn.Module):
    """``branch``: an extra layer the forward uses only when asked (``use_branch``): a parameter
    unused on some steps, which DDP needs ``find_unused_parameters=True`` for."""

    def __init__(self, dropout: float, batchnorm: bool = False, branch: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, 64)
        self.norm = nn.BatchNorm1d(64) if batchnorm else nn.Identity()
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(64, CLASSES)
        if branch:
            self.branch = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, use_branch: bool = False) -> torch.Tensor:
        h = F.relu(self.norm(self.fc1(x)))
        if use_branch:
            h = h + self.branch(h)
        return self.fc2(self.drop(h))


def make_dataset(seed: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, DIM, generator=g)
    y = torch.randint(CLASSES, (SAMPLES,), generator=g)
    return torch.utils.data.TensorDataset(x, y)


class Augmented(torch.utils.data.Dataset):
    """``dataset`` with augmentation drawn from the global streams of the process that fetches."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        x, y = self.dataset[index]
        sign = -1.0 if random.random() < 0.5 else 1.0
        return sign * x + 0.05 * torch.randn(x.shape), y


class LoaderSource:
    """A StatefulDataLoader over a DistributedSampler, re-iterated (with set_epoch) per epoch."""

    def __init__(self, dataset, rank: int, world_size: int, batch_size: int, num_workers: int, seed: int) -> None:
        from torchdata.stateful_dataloader import StatefulDataLoader

        self.sampler = torch.utils.data.distributed.DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.loader = StatefulDataLoader(dataset, batch_size=batch_size, sampler=self.sampler,
                                         num_workers=num_workers, drop_last=True)
        self.epoch = 0
        self.sampler.set_epoch(0)
        self._iter = None

    def next_batch(self):
        if self._iter is None:
            self._iter = iter(self.loader)
        try:
            return next(self._iter)
        except StopIteration:
            self.epoch += 1
            self.sampler.set_epoch(self.epoch)
            self._iter = iter(self.loader)
            return next(self._iter)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.sampler.set_epoch(self.epoch)
        self.loader.load_state_dict(state["loader"])
        self._iter = None


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--data", choices=("sampler", "loader", "step"), default="sampler")
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--augment", action="store_true", help="loader: random augmentation where samples are fetched")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--per-rank-seed", action="store_true")
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--optimizer", choices=("plain", "sharded"), default="plain")
    p.add_argument("--phases", action="store_true", help="plain: mark job.phase('sync'/'update') by hand")
    p.add_argument("--wrapper", choices=("none", "ddp", "ddp-own-group"), default="none")
    p.add_argument("--batchnorm", action="store_true")
    p.add_argument("--find-unused", action="store_true",
                   help="ddp: find_unused_parameters=True and a branch the forward uses on every third step only")
    p.add_argument("--static-graph", action="store_true", help="ddp: static_graph=True")
    p.add_argument("--step-sleep-s", type=float, default=0.0)
    p.add_argument("--log", default="")
    p.add_argument("--out", required=True)
    return p.parse_args()


def digest(obj) -> str:
    return hashlib.blake2b(repr(obj).encode(), digest_size=8).hexdigest()


def append_line(path: str, value) -> None:
    with open(path, "a") as f:
        f.write(f"{value}\n")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    job = unbroken.init()
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    random.seed(args.seed)
    model = Net(args.dropout, args.batchnorm, branch=args.find_unused).to(job.device)
    if args.per_rank_seed:
        torch.manual_seed(args.seed * 1000 + job.rank)  # dropout differs by rank from here on
        random.seed(args.seed * 1000 + job.rank)
    if args.wrapper == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=args.find_unused,
                                                          static_graph=args.static_graph)
    elif args.wrapper == "ddp-own-group":
        model = torch.nn.parallel.DistributedDataParallel(model, process_group=dist.new_group(backend="gloo"))
    params = [p for p in model.parameters()]
    if args.optimizer == "sharded":
        opt = unbroken.optim.ShardedOptimizer(params, optimizer_class=torch.optim.AdamW, num_replicas=2,
                                              process_group=job.process_group, lr=1e-2)
    else:
        opt = torch.optim.AdamW(params, lr=1e-2)
    dataset = make_dataset(args.seed)
    if args.data == "sampler":
        source = ShardSampler(len(dataset), job.rank, job.world_size, args.seed)
    elif args.data == "loader":
        source = LoaderSource(Augmented(dataset) if args.augment else dataset, job.rank, job.world_size, args.batch_size, args.num_workers, args.seed)
    else:
        source = None  # the batch is a function of (step, rank)
    job.track(model=model, optimizer=opt, data=source)  # data=None is not tracked
    manual = args.optimizer == "plain" and args.wrapper == "none" and job.world_size > 1

    for step in job.steps(args.steps):
        with job.step():
            if args.data == "sampler":
                x, y = dataset[source.take(args.batch_size)]
            elif args.data == "step":
                g = torch.Generator().manual_seed(args.seed * 100_003 + step * 101 + job.rank)
                x, y = dataset[torch.randint(SAMPLES, (args.batch_size,), generator=g)]
            else:
                x, y = source.next_batch()
            x = x + 0.01 * random.random()  # a draw from Python's RNG too, per rank when seeded so
            logits = model(x.to(job.device), use_branch=True) if args.find_unused and step % 3 == 0 else \
                model(x.to(job.device))
            loss = F.cross_entropy(logits, y.to(job.device))
            loss.backward()
            if manual:
                if args.phases:
                    job.phase("sync")
                flat = torch.cat([p.grad.reshape(-1) for p in params])
                job.all_reduce(flat)
                flat.div_(job.world_size)
                offset = 0
                for p in params:
                    p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                    offset += p.numel()
                if args.phases:
                    job.phase("update")
            opt.step()
            opt.zero_grad(set_to_none=True)
            if args.step_sleep_s:
                time.sleep(args.step_sleep_s)
            job.report(loss=loss.item())
            if args.log:  # post-step code inside the block: runs once per completed step
                append_line(f"{args.log}.rank{job.rank}", step)
        if args.log and job.step_completed:  # after the block: only for a step that completed
            append_line(f"{args.log}.after.rank{job.rank}", step)

    state = {"torch_rng": digest(torch.get_rng_state().tolist()), "py_rng": digest(random.getstate()),
             "data": digest(source.state_dict() if args.data == "sampler" else getattr(source, "epoch", None)),
             "probe": torch.rand(3).tolist()}
    with open(f"{args.out}.rank{job.rank}.json", "w") as f:
        json.dump(state, f)
    if job.rank == 0:
        module = model.module if args.wrapper != "none" else model
        save_file({k: v.detach().clone().contiguous() for k, v in module.state_dict().items()}, args.out)
    job.close()


if __name__ == "__main__":
    main()
