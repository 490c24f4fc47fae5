"""A tiny data-parallel script for the pre-run spare tests (--prerun-spares).

Usage: prerun_script.py OUT STEPS GATE_DIR [--read-rank-early]

Builds its model and optimizer before ``job.steps()`` (so a pre-run spare blocks there), trains
STEPS steps (gradients averaged with ``job.all_reduce``, batches from the step and the rank); rank 0
writes the final weights to OUT (safetensors), every rank R to OUT.rankR. Before step S every rank waits until the
file ``GATE_DIR/S`` exists, for each S named by a file ``GATE_DIR/S.hold`` present at start: the
test kills a rank while the job is held there and then opens the gate, so the kill lands after
the spare is ready and the step count stays fixed (each rank held at S writes ``GATE_DIR/atS-rankR``). ``--read-rank-early``: reads ``RANK`` from the
environment before ``unbroken.init()`` (what a pre-run spare cannot do: it falls back to warm).
"""

import os
import sys
import time

import torch
from safetensors.torch import save_file

out, steps, gate_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if "--read-rank-early" in sys.argv:
    early_rank = int(os.environ["RANK"])  # a KeyError in a pre-run spare

import unbroken  # noqa: E402

job = unbroken.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
job.track(model=model, optimizer=opt)
holds = {int(name[:-5]) for name in os.listdir(gate_dir) if name.endswith(".hold")}
for step in job.steps(steps):
    if step in holds:
        open(os.path.join(gate_dir, f"at{step}-rank{job.rank}"), "w").close()  # held here
    while step in holds and not os.path.exists(os.path.join(gate_dir, str(step))):
        time.sleep(0.05)
    with job.step():
        g = torch.Generator().manual_seed(step * 100 + job.rank)
        loss = model(torch.randn(8, 16, generator=g)).pow(2).mean()
        loss.backward()
        for p in model.parameters():
            job.all_reduce(p.grad)
            p.grad /= job.world_size
        opt.step()
        opt.zero_grad()
    job.report(loss=loss)
weights = {k: v.contiguous() for k, v in model.state_dict().items()}
if job.rank == 0:
    save_file(weights, out)
save_file(weights, f"{out}.rank{job.rank}")  # every rank's copy: replicas must end equal
job.close()
