"""A slow 2-rank loop that records a SIGTERM it gets (argv[1]: the folder for the marker files).

On SIGTERM each rank writes ``sigterm-r<rank>`` there and exits 0: the test sees that the
launcher forwarded the signal and let the worker finish its own clean-up (no SIGKILL first).
"""

import signal
import sys
import time
from pathlib import Path

import torch

import unbroken

marks = Path(sys.argv[1])
job = unbroken.init()


def on_sigterm(signum, frame):
    (marks / f"sigterm-r{job.rank}").write_text("got SIGTERM\n")
    sys.exit(0)


signal.signal(signal.SIGTERM, on_sigterm)
weight = torch.zeros(8)
job.track(weight=weight)
for step in job.steps(10_000):
    with job.step():
        grad = torch.ones(8)
        job.phase("sync")
        job.all_reduce(grad)
        job.phase("update")
        weight.add_(grad, alpha=-0.01)
    if step == 3:
        (marks / f"running-r{job.rank}").write_text("at step 3\n")
    time.sleep(0.05)
