"""A survivor that ends the job with an abandoned op still pending exits cleanly (2 gloo processes).

Before the fix the rank holding the pending op was aborted at interpreter exit ("terminate called
after throwing an instance of 'gloo::IoException'" once its peer exited; 4 of 4 runs here): in a
pipeline x data-parallel job a survivor's dp all-reduce with a peer that left the step before it
stays pending, nothing in the new generation fails it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.conftest import REPO, free_port

WORKER = Path(__file__).with_name("exit_worker.py")


@pytest.mark.timeout(240)
def test_a_rank_with_an_abandoned_op_pending_exits_cleanly():
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO) for r in range(2)]
    outs = []
    try:
        outs = [p.communicate(timeout=200)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert "rank 1: pending before close 1" in outs[1], outs[1]
    assert [p.returncode for p in procs] == [0, 0], outs
    del store
