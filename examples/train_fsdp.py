"""Train the tiny GPT of train_gpt.py with FSDP2 (`fully_shard`), HSDP on a 2-D mesh, through failures.

The script a PyTorch user already has: a `DeviceMesh` (replicate x shard), `fully_shard` on each
transformer block and on the root, AdamW over the sharded (DTensor) parameters. What unbroken
adds is four lines: `unbroken.init()`, `job.track(...)`, `job.steps(...)` and `with job.step():`.

    torchrun --nproc-per-node 4 examples/train_fsdp.py                     # job-level restarts only
    unbroken run --nproc-per-node 4 --inject kill:rank=2:step=30:at=sync examples/train_fsdp.py --out w.safetensors
                                                                           # HSDP 2x2: in flight, same bits
    unbroken run --nproc-per-node 4 ... examples/train_fsdp.py --replicas 1  # pure FSDP: memory tier

With `--replicas 2` (HSDP, the default on 4 ranks) every parameter and optimizer shard is held by
two ranks, the ones with the same shard coordinate in each replica: a lost rank is replaced in
flight and receives its local shards from its peer in the other replica. With `--replicas 1`
(pure FSDP) a shard has one holder: a lost rank's shards exist only in the checkpoint tiers, so
the job restarts from the newest memory-tier snapshot (steps lost are reported). Either way the
final weights equal the fault-free run's bit for bit. The model, the data and the schedule are
train_gpt.py's.
"""

import argparse
import time

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import unbroken
from train_gpt import GPT, GPTConfig, get_batch, load_data, lr_multiplier, parse_args, save_tensors


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """train_gpt.py's flags (its --optimizer is ignored: AdamW over the shards), plus --replicas."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--replicas", type=int, default=2,
                   help="size of the mesh's replicate dimension (HSDP); 1 is pure FSDP (no replica)")
    own, rest = p.parse_known_args(argv)
    if own.replicas < 1:
        p.error(f"--replicas must be >= 1, got {own.replicas}")
    args = parse_args(rest)
    args.replicas = own.replicas
    return args


def build_mesh(job: "unbroken.Job", replicas: int):
    """(replicate, shard) over the job's ranks: rank r holds shard r % (world / replicas)."""
    if job.world_size % replicas:
        raise SystemExit(f"train_fsdp.py: --replicas {replicas} does not divide the world size "
                         f"{job.world_size}; pick a divisor of the number of ranks")
    if replicas == 1:
        return init_device_mesh(job.device.type, (job.world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(job.device.type, (replicas, job.world_size // replicas),
                            mesh_dim_names=("replicate", "shard"))


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    torch.set_num_threads(args.num_threads)  # part of the run's identity: it changes float results
    job = unbroken.init()                    # joins the job; builds the default process group
    mesh = build_mesh(job, args.replicas)    # its groups are sub-groups of the default one
    data, vocab = load_data()
    cfg = GPTConfig(vocab_size=len(vocab), block_size=args.block_size, n_layer=args.n_layer,
                    n_head=args.n_head, n_embd=args.n_embd, dropout=args.dropout)
    torch.manual_seed(args.seed)             # same seed on every rank -> identical initial weights
    model = GPT(cfg).to(job.device)
    for block in model.transformer.h:        # one all-gather / reduce-scatter per block ...
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)            # ... and one for the rest (embeddings, final norm, tied head)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    warmup_steps = min(args.warmup_steps, args.steps)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: lr_multiplier(step, warmup_steps=warmup_steps, total_steps=args.steps))
    job.track(model=model, optimizer=opt, scheduler=sched)  # local shards: nothing is gathered
    t0 = time.perf_counter()
    for step in job.steps(args.steps):
        with job.step():  # the fault boundary: a failure in here redoes this step
            # The batch of (step, rank) is a pure function of them: a redone step sees the same data.
            # Every rank gets its own batch (FSDP is data parallel over the whole mesh).
            x, y = get_batch(data, step, job.rank, seed=args.seed, batch_size=args.batch_size,
                             block_size=args.block_size)
            _, loss = model(x.to(job.device), y.to(job.device))  # all-gathers each block's parameters
            loss.backward()                  # reduce-scatters (and, with replicas, all-reduces) gradients
            opt.step()                       # each rank updates its own shards
            opt.zero_grad(set_to_none=True)
            sched.step()
            if args.step_sleep_s:
                time.sleep(args.step_sleep_s)
            job.report(loss=loss.item())
            t1 = time.perf_counter()
            if job.rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
                print(f"step {step}: loss {loss.item():.4f}, {(t1 - t0) * 1000:.1f} ms", flush=True)
            t0 = t1
    if args.out:  # a collective: every rank takes part, rank 0 writes the full weights
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if job.rank == 0:
            save_tensors(full, args.out)
    job.close()


if __name__ == "__main__":
    main()
