"""A small data-parallel training script that runs until the test says at which step to stop.

Every rank trains a linear model (gradients averaged with ``job.all_reduce``, so in-flight
recovery works) at about 20 steps a second, for at most argv[2] steps. The test writes a
step number S into the file argv[1] (atomically, while the job is a few steps before S);
every rank then stops after step S, so a test can look at the live job for as long as it
needs, then let it finish cleanly.
"""

import os
import sys
import time

import torch

import unbroken

gate, max_steps = sys.argv[1], int(sys.argv[2])
job = unbroken.init()
torch.manual_seed(0)
model = torch.nn.Linear(16, 16)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
job.track(model=model, optimizer=opt)
for step in job.steps(max_steps):
    with job.step():
        g = torch.Generator().manual_seed(step * 100 + job.rank)
        loss = model(torch.randn(8, 16, generator=g)).pow(2).mean()
        loss.backward()
        job.phase("sync")
        for p in model.parameters():
            job.all_reduce(p.grad)
            p.grad /= job.world_size
        job.phase("update")
        opt.step()
        opt.zero_grad()
        time.sleep(0.05)
    job.report(loss=loss)
    if os.path.exists(gate) and step >= int(open(gate).read()):
        break
job.close()
