"""A 2-rank training script whose rank 1 kills itself with SIGKILL right after its step loop
(as a rank crashing at interpreter exit would die): its training is done, the job's is too."""

import os
import signal

import torch

import unbroken

job = unbroken.init()
model = torch.nn.Linear(4, 4)
job.track(model=model)
for step in job.steps(4):
    with job.step():
        job.all_reduce(torch.ones(1))
if job.rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
job.close()
