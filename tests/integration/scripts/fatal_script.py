"""A 2-rank training script that rank 1 ends in a way no restart can fix.

MODE (argv[1]): ``track``: a ConfigError from job.track (the library exits with EXIT_FATAL);
``exit``: the script itself calls sys.exit(unbroken.EXIT_FATAL); ``bug``: a plain exception
at step 2, every time (a bug in the script: no restart fixes it, the crash-loop rule stops it);
``bug-all``: every rank raises at step 1, its rank in the message, a different rank first in each
attempt (whichever rank the controller sees first, it is one deterministic error); ``ema``: rank 1's
loop updates an EMA copy of the model it did not track (refused after the first step).
"""

import os
import sys
import time

import torch

import unbroken

mode = sys.argv[1]
job = unbroken.init()
model = torch.nn.Linear(4, 4)
if job.rank == 1 and mode == "track":
    job.track(model=model, data=object())  # an object without state_dict: ConfigError
if job.rank == 1 and mode == "exit":
    print("rank 1: the dataset is missing; giving up", flush=True)
    job.close()
    sys.exit(unbroken.EXIT_FATAL)
ema = torch.nn.Linear(4, 4)
job.track(model=model)
for step in job.steps(3):
    with job.step():
        if job.rank == 1 and mode == "ema":
            with torch.no_grad():
                ema.weight.mul_(0.9).add_(model.weight, alpha=0.1)
        if job.rank == 1 and mode == "bug" and step == 2:
            raise ValueError("batch 2 is empty")
        if mode == "bug-all" and step == 1:
            if job.rank != int(os.environ["TORCHELASTIC_RESTART_COUNT"]) % job.world_size:
                time.sleep(1.0)  # the attempt's first to fail is rank (attempt % world)
            raise ValueError(f"rank {job.rank}: batch 1 has the wrong shape")
        job.all_reduce(torch.ones(1))
job.close()
