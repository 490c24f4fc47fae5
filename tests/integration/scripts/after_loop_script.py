"""A small data-parallel training script for the end of a job (tests/integration/test_after_loop.py).

Without arguments: 2 ranks, 4 steps, and rank 1 kills itself with SIGKILL right after its step loop
(as a rank crashing at interpreter exit would die): its training is done, the job's is too.

``--wait-at POINT --wait-rank R``: rank R prints ``WAITING rank=R at=POINT pid=PID`` and sleeps there
(up to ``--wait-s``), so that a test can SIGSTOP it from outside at that point:

* ``before-first-step``: after ``job.track()``, before ``job.steps()``;
* ``last-step``: inside the last step's ``with job.step():``, before its gradient reduction;
* ``last-step-done``: in the last iteration of the loop, after its ``with job.step():`` block (the
  step is committed and done; the other ranks leave their loops without it);
* ``after-loop``: after the step loop, where the script makes its final save, before ``job.close()``.

Only the first process to get there waits (a marker file next to ``--out``): a replacement or a
restarted job runs through.

Every rank reduces its gradients with ``job.all_reduce``; rank 0 writes the final weights to ``--out``
(safetensors) after its loop, then every rank calls ``job.close()``.
"""

import argparse
import os
import signal
import sys
import time

import torch
from safetensors.torch import save_file

import unbroken

POINTS = ("before-first-step", "last-step", "last-step-done", "after-loop")

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=4)
p.add_argument("--out", default="")
p.add_argument("--wait-at", choices=POINTS, default=None)
p.add_argument("--wait-rank", type=int, default=1)
p.add_argument("--wait-s", type=float, default=60.0)
args = p.parse_args()

job = unbroken.init()


def wait_here(point: str) -> None:
    """The rank the test stops: say where it is, then idle until the SIGSTOP lands."""
    if args.wait_at == point and job.rank == args.wait_rank:
        try:
            open(f"{args.out}.waited", "x").close()
        except FileExistsError:
            return  # it waited there once, and was stopped: this is its replacement, or the job restarted
        print(f"WAITING rank={job.rank} at={point} pid={os.getpid()}", flush=True)
        time.sleep(args.wait_s)


torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
job.track(model=model, optimizer=opt)
wait_here("before-first-step")
for step in job.steps(args.steps):
    with job.step():
        g = torch.Generator().manual_seed(1000 * step + job.rank)  # this rank's batch of this step
        x = torch.randn(16, 8, generator=g)
        loss = (model(x) - x).pow(2).mean()
        loss.backward()
        if step == args.steps - 1:
            wait_here("last-step")
        for param in model.parameters():
            job.all_reduce(param.grad)
            param.grad /= job.world_size
        opt.step()
        opt.zero_grad()
    if step == args.steps - 1:
        wait_here("last-step-done")
    if job.rank == 0:
        print(f"step {step} done", flush=True)

if args.wait_at is None and job.rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
if job.rank == 0 and args.out:
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, args.out)
wait_here("after-loop")
job.close()
sys.exit(0)
