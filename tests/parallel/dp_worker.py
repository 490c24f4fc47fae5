"""One rank of the standalone data-parallel job of tests/parallel (stock DDP or FSDP2 HSDP).

Started by :mod:`tests.parallel.dp_launch`, which plays the controller: it hosts the
TCPStore, starts the ranks, notices a rank's death, publishes ``abort/<gen>`` (the lost
ranks) once the dead process is reaped, and starts the replacement with ``--gen <gen+1>``.

A rank builds its groups on a :class:`unbroken.parallel.fabric.Fabric` (detached), builds
the stock wrapper and optimizer on them, joins generation ``--gen`` and trains. A step whose
collectives fail or are aborted is dropped (gradients cleared, buffers put back to the
step's start); every rank then joins the next generation and the lowest surviving rank of
each replica set sends the state to the replacement. At the end each rank writes its
parameters (its local shards for FSDP2) to ``<out>/rank<R>.pt`` and a JSON line of facts.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from unbroken.comm import wait_all
from unbroken.parallel import ddp as ddp_gen
from unbroken.parallel.fabric import Fabric
from unbroken.state.dtypes import dtype_name, dtype_named
from unbroken.state.tree import flatten_state, unflatten_state


class StoreAbortWatcher(threading.Thread):
    """Fires the fabric's abort signal when ``abort/<current gen>`` appears in the store.

    Uses its own store connection (a blocked ``wait`` holds the client's lock). Daemon thread.
    """

    def __init__(self, host: str, port: int, fabric: Fabric) -> None:
        super().__init__(daemon=True, name="abort-watcher")
        self._store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=60),
                                    wait_for_workers=False)
        self._fabric, self.lost_by_gen = fabric, {}

    def run(self) -> None:
        fired_for = None
        while True:
            gen = self._fabric.generation
            if gen == fired_for or gen < 0:
                time.sleep(0.002)
                continue
            if not self._store.check([f"abort/{gen}"]):
                time.sleep(0.005)
                continue
            lost = self._store.get(f"abort/{gen}").decode()
            self.lost_by_gen[gen] = [int(r) for r in lost.split(",")]
            fired_for = gen
            self._fabric.signal.fire(f"generation {gen}: rank(s) {lost} lost")


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(16, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU()]
    for _ in range(3):
        layers += [torch.nn.Linear(64, 64), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(64, 4))
    return torch.nn.Sequential(*layers)


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    return torch.randn(16, 16, generator=g), torch.randn(16, 4, generator=g)


def arm_kill(model: torch.nn.Module, step_box: list[int], kill_step: int) -> None:
    """SIGKILL this process inside the backward of step ``kill_step`` (first layer's grad:
    the last one computed, after the other buckets' all-reduces went out)."""
    def hook(grad):
        if step_box[0] == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        return grad
    first = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    first.weight.register_hook(hook)


def train_step(wrapped, opt, step: int, rank: int, micro_batches: int) -> None:
    for micro in range(micro_batches):
        x, y = batch(step, micro, rank)
        last = micro == micro_batches - 1
        ctx = wrapped.no_sync() if (not last and hasattr(wrapped, "no_sync")) else _null()
        with ctx:
            F.mse_loss(wrapped(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main() -> int:
    p = argparse.ArgumentParser()
    for name in ("rank", "world", "port", "steps", "gen"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--kill-step", type=int, default=-1)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--timeout-s", type=float, default=30.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", args.port, is_master=False, timeout=timedelta(seconds=60),
                          wait_for_workers=False)
    fabric = Fabric(store, args.rank, args.world, timeout_s=args.timeout_s, name="dp")
    group = fabric.init_world()
    watcher = StoreAbortWatcher("127.0.0.1", args.port, fabric)
    model = build_model()
    # Built detached: DDP's constructor collectives (shape check, module broadcast) run locally.
    wrapped = torch.nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.02)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    step_box = [0]
    if args.kill_step >= 0:
        arm_kill(model, step_box, args.kill_step)
    facts = {"rank": args.rank, "pid": os.getpid(), "first_gen": args.gen, "recoveries": []}
    if args.gen > 0:  # a replacement: tell the survivors it is ready (the controller's regroup order)
        store.set(f"ready/{args.gen}", str(os.getpid()))
    fabric.switch(args.gen)
    watcher.start()
    step = 0
    if args.gen > 0:  # a replacement: the state comes from a survivor
        step = _transfer(fabric, wrapped, opt, step, lost=[args.rank], facts=facts)
    while step < args.steps:
        step_box[0] = step
        buffers = {n: b.clone() for n, b in model.named_buffers()}
        try:
            train_step(wrapped, opt, step, args.rank, args.micro)
            step += 1
            continue
        except Exception as err:  # noqa: BLE001 - aborted or a dead peer: drop the step
            aborted_at = time.monotonic()
            facts["recoveries"].append({"step": step, "error": type(err).__name__, "msg": str(err)[:200]})
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for n, b in model.named_buffers():
                b.copy_(buffers[n])
        ddp_gen.reset_after_abort(wrapped)
        gen = fabric.generation
        while gen not in watcher.lost_by_gen:  # gloo saw the death first: wait for the order
            time.sleep(0.002)
        facts["recoveries"][-1]["left_s"] = time.monotonic() - aborted_at
        store.wait([f"ready/{gen + 1}"], timedelta(seconds=300))  # the replacement has started
        facts["recoveries"][-1]["switch_s"] = fabric.switch(gen + 1)
        step = _transfer(fabric, wrapped, opt, step, lost=watcher.lost_by_gen[gen], facts=facts)
        facts["recoveries"][-1]["back_s"] = time.monotonic() - aborted_at
    facts["graveyard_pending"] = fabric.prune_graveyard()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.out / f"rank{args.rank}.pt")
    with open(args.out / f"rank{args.rank}.json", "w") as f:
        json.dump(facts, f)
    os._exit(0)  # abandoned gloo ops may still be pending: never wait for their destructors


def _transfer(fabric: Fabric, wrapped, opt, step: int, lost: list[int], facts: dict) -> int:
    """Every rank: the lowest survivor sends module, optimizer, step and DDP layout."""
    src = min(r for r in range(fabric.world_size) if r not in lost)
    me = fabric.rank
    tree = None
    if me == src:
        tree = {"model": wrapped.module.state_dict(), "opt": opt.state_dict(), "step": step,
                "layout": ddp_gen.bucket_layout(wrapped)}
    got = broadcast_state(tree, src, dist.group.WORLD, device=torch.device("cpu"),
                          should_abort=fabric.signal.is_set, graveyard=fabric.graveyard,
                          what=f"state transfer from rank {src}")
    if me in lost:
        wrapped.module.load_state_dict(got["model"])
        opt.load_state_dict(got["opt"])
        ddp_gen.adopt_layout(wrapped, got["layout"])
    elif got["step"] != step:
        raise RuntimeError(f"rank {me} is at step {step} but the source rank {src} resumes at {got['step']}")
    return got["step"]


def broadcast_state(tree, src: int, group, *, device: torch.device, should_abort, graveyard: list, what: str):
    """Broadcast ``tree`` from group rank ``src`` (its state tree: a header with the meta's and the
    data's lengths, the meta as JSON, every tensor in one byte buffer); every rank returns the
    source's tree. The library moves state point to point (unbroken.comm.p2p); this harness keeps
    the simplest transfer there is, with the same codec and the same abortable waits."""
    header = torch.zeros(2, dtype=torch.int64, device=device)
    if group.rank() == src:
        tensors, spec = flatten_state(tree)
        index = [[name, dtype_name(t.dtype), list(t.shape), t.numel() * t.element_size()] for name, t in tensors.items()]
        meta = json.dumps({"spec": spec, "index": index}).encode()
        header[0], header[1] = len(meta), sum(entry[3] for entry in index)
    wait_all([dist.broadcast(header, group_src=src, group=group, async_op=True)], should_abort, graveyard, what)
    meta_buf = torch.empty(int(header[0]), dtype=torch.uint8, device=device)
    data = torch.empty(int(header[1]), dtype=torch.uint8, device=device)
    if group.rank() == src:
        meta_buf.copy_(torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(device))
        offset = 0
        for t in tensors.values():
            n = t.numel() * t.element_size()
            data[offset:offset + n].copy_(t.to(device).detach().contiguous().reshape(-1).view(torch.uint8))
            offset += n
    works = [dist.broadcast(meta_buf, group_src=src, group=group, async_op=True)]
    if data.numel():
        works.append(dist.broadcast(data, group_src=src, group=group, async_op=True))
    wait_all(works, should_abort, graveyard, what)
    if group.rank() == src:
        return tree
    decoded = json.loads(bytes(meta_buf.cpu().numpy()).decode())
    out, offset = {}, 0
    for name, dtype, shape, nbytes in decoded["index"]:
        out[name] = data[offset:offset + nbytes].clone().view(dtype_named(dtype)).reshape(shape)
        offset += nbytes
    return unflatten_state(out, decoded["spec"])


if __name__ == "__main__":
    sys.exit(main())
