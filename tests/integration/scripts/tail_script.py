"""A reduction after the step's first optimizer update, and what the step does after it.

2 ranks, the manual path (``job.all_reduce`` of the gradients), MODE (``--mode``):

* ``gan``: a second model's gradients are reduced after the first optimizer's step, and a second
  optimizer updates from them (a GAN's generator after its discriminator);
* ``logreduce``: the loss is all-reduced for logging after the optimizer step, then the tracked
  scheduler steps;
* ``evalreduce``: after the optimizer step, ``model.eval()``, a validation loss all-reduced across
  the ranks, then ``model.train()`` (the model has dropout: its mode matters to the next steps);
* ``logonly``: the loss is all-reduced for logging after the optimizer step, and nothing follows.

``--die-step K``: rank 1 kills itself (SIGKILL) in step K right after the first optimizer step,
before that reduction (once: ``--marker`` records it), so rank 0 is cut inside it. Every rank
writes its modules and the scheduler's learning rate to ``OUT.rank<r>.safetensors``.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
from safetensors.torch import save_file

import unbroken


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("gan", "logreduce", "evalreduce", "logonly"), required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--die-step", type=int, default=-1)
    p.add_argument("--marker", default="")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    job = unbroken.init()
    torch.manual_seed(0)
    model, other = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.3)), torch.nn.Linear(4, 1)
    opt_a = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(other.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt_a, step_size=1, gamma=0.9)
    job.track(model=model, other=other, opt_a=opt_a, opt_b=opt_b, sched=sched)
    for step in job.steps(args.steps):
        with job.step():
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step * 31 + job.rank))
            loss = model(x).square().mean()
            loss.backward()
            for param in model.parameters():
                job.all_reduce(param.grad)
                param.grad /= job.world_size
            opt_a.step()  # the step's first update: it commits here
            opt_a.zero_grad()
            if job.rank == 1 and step == args.die_step and not os.path.exists(args.marker):
                open(args.marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)  # rank 0 waits in the reduction below: cut inside it
            time.sleep(0.02)
            if args.mode == "gan":
                other(model(x).detach()).square().mean().backward()
                for param in other.parameters():
                    job.all_reduce(param.grad)  # a reduction after the commit ...
                opt_b.step()  # ... that an update depends on
                opt_b.zero_grad()
            elif args.mode == "evalreduce":
                model.eval()
                with torch.no_grad():
                    val = model(torch.ones(2, 4)).square().mean()
                job.all_reduce(val)  # a validation loss, reduced after the update ...
                model.train()  # ... then the model back in training mode
            else:
                job.all_reduce(loss.detach().clone())  # a logged loss, reduced after the update ...
                if args.mode == "logreduce":
                    sched.step()  # ... then the schedule moves
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    state.update({f"other.{k}": v for k, v in other.state_dict().items()})
    state["lr"] = torch.tensor(opt_a.param_groups[0]["lr"])
    save_file(state, f"{args.out}.rank{job.rank}.safetensors")
    job.close()


if __name__ == "__main__":
    main()
