"""A 4-rank loop whose rank SLOW (argv[1]) computes 0.25 s longer per step from step 3 on.

Reports its phases like an optimizer does (compute -> sync -> update), so the controller can
time each rank's compute part.
"""

import sys
import time

import torch

import unbroken

slow = int(sys.argv[1])
job = unbroken.init()
weight = torch.zeros(8)
job.track(weight=weight)
for step in job.steps(24):
    with job.step():
        if job.rank == slow and step >= 3:
            time.sleep(0.25)  # a throttled device
        grad = torch.ones(8)
        job.phase("sync")
        job.all_reduce(grad)
        job.phase("update")
        weight.add_(grad, alpha=-0.01)
job.close()
