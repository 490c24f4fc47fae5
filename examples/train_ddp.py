"""Train the tiny GPT of train_gpt.py with stock DistributedDataParallel, through failures.

The script a PyTorch user already has: `DistributedDataParallel(model)`, AdamW, gradient
accumulation with `no_sync()`. What unbroken adds is four lines: `unbroken.init()`,
`job.track(...)`, `job.steps(...)` and `with job.step():`.

    torchrun --nproc-per-node 4 examples/train_ddp.py                 # job-level restarts only
    unbroken run --nproc-per-node 4 --inject kill:rank=2:step=30:at=sync examples/train_ddp.py --out w.safetensors
                                                                      # recovered in flight, same bits

Under `unbroken run` (CPU, gloo) the default process group is one that survives an in-flight
recovery, so the DDP built on it keeps its buckets and hooks: a lost rank is replaced, the
survivors leave the broken all-reduce, the step is redone, and the final weights equal the
fault-free run's bit for bit. The model, the data and the schedule are train_gpt.py's.
"""

import argparse
import contextlib
import time

import torch
from torch.nn.parallel import DistributedDataParallel

import unbroken
from train_gpt import GPT, GPTConfig, get_batch, load_data, lr_multiplier, parse_args, save_weights


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """train_gpt.py's flags (its --optimizer is ignored: this is AdamW under DDP), plus --grad-accum."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--grad-accum", type=int, default=2, help="micro-batches per step (>= 1), all but the "
                                                             "last under no_sync()")
    own, rest = p.parse_known_args(argv)
    if own.grad_accum < 1:
        p.error(f"--grad-accum must be >= 1, got {own.grad_accum}")
    args = parse_args(rest)
    args.grad_accum = own.grad_accum
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    torch.set_num_threads(args.num_threads)  # part of the run's identity: it changes float results
    job = unbroken.init()                    # joins the job; builds the default process group
    data, vocab = load_data()
    cfg = GPTConfig(vocab_size=len(vocab), block_size=args.block_size, n_layer=args.n_layer,
                    n_head=args.n_head, n_embd=args.n_embd, dropout=args.dropout)
    torch.manual_seed(args.seed)             # same seed on every rank -> identical initial weights
    model = DistributedDataParallel(GPT(cfg).to(job.device))  # the default group: nothing else to pass
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    warmup_steps = min(args.warmup_steps, args.steps)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: lr_multiplier(step, warmup_steps=warmup_steps, total_steps=args.steps))
    job.track(model=model, optimizer=opt, scheduler=sched)
    t0 = time.perf_counter()
    for step in job.steps(args.steps):
        with job.step():  # the fault boundary: a failure in here redoes this step
            for micro in range(args.grad_accum):
                # The batch of (step, micro-batch, rank) is a pure function of them: a redone
                # step sees the same data. DDP all-reduces only after the last micro-batch.
                x, y = get_batch(data, step * args.grad_accum + micro, job.rank, seed=args.seed,
                                 batch_size=args.batch_size, block_size=args.block_size)
                last = micro == args.grad_accum - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    _, loss = model(x.to(job.device), y.to(job.device))
                    (loss / args.grad_accum).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            if args.step_sleep_s:
                time.sleep(args.step_sleep_s)
            job.report(loss=loss.item())
            t1 = time.perf_counter()
            if job.rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
                print(f"step {step}: loss {loss.item():.4f}, {(t1 - t0) * 1000:.1f} ms", flush=True)
            t0 = t1
    if job.rank == 0 and args.out:
        save_weights(model.module, args.out)
    job.close()


if __name__ == "__main__":
    main()
