"""Imports a module (the test's marker module, importable by name from PYTHONPATH) before
``unbroken.init()``, then trains a few tiny steps until the marker file names a process other
than this one (the node's warm spare, which imported the module too), at most argv[1] seconds.
"""

import os
import sys
import time

import preimport_marker  # noqa: F401  - writes this process's pid into $T17A_MARKER on import
import torch

import unbroken

deadline = time.monotonic() + float(sys.argv[1])
job = unbroken.init()
weights = torch.zeros(4)
job.track(weights=weights)
marker = os.environ["T17A_MARKER"]
for step in job.steps(10_000):
    with job.step():
        weights += 1
        time.sleep(0.05)
    pids = {int(p) for p in open(marker).read().split()}
    if pids - {os.getpid()} or time.monotonic() > deadline:
        break
job.close()
