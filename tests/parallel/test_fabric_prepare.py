"""Fabric.prepare: the next generation's backends built ahead of the switch (lazy connections
only). In a child process: the fabric makes the default process group its own."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

CHILD = r'''
import json, sys
import torch, torch.distributed as dist
from unbroken.parallel.fabric import Fabric

lazy = sys.argv[1] == "lazy"
store = dist.HashStore()
fabric = Fabric(store, 0, 1, timeout_s=10.0, name="prepare", lazy_connect=lazy)
fabric.init_world()
fabric.switch(0)
out = {"start": store.num_keys()}
fabric.prepare(1)                    # built now ...
out["prepared"] = store.num_keys()
fabric.switch(1)                     # ... and used as they are: nothing more is built
out["switched"] = store.num_keys()
t = torch.ones(3)
dist.all_reduce(t)
out["sum"] = t.tolist()
out["graveyard"] = len(fabric.graveyard)
fabric.prepare(2)                    # prepared for a generation the job skips:
fabric.switch(3)                     # built again, the prepared ones to the graveyard
out["skipped_graveyard"] = len(fabric.graveyard)
fabric.prepare(3)                    # not newer than the current generation: nothing
out["stale"] = store.num_keys()
fabric.close()
print(json.dumps(out))
'''


def _run(mode: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_prepared_backends_are_used_by_the_switch_and_dropped_when_skipped():
    out = _run("lazy")
    assert out["prepared"] > out["start"] and out["switched"] == out["prepared"], out
    assert out["sum"] == [1.0, 1.0, 1.0]
    assert out["graveyard"] == 1  # generation 0's backend
    assert out["skipped_graveyard"] == 3  # + generation 1's, + the one prepared for generation 2
    assert out["stale"] == out["switched"] + 2 * (out["prepared"] - out["start"])  # gen 2 and 3 builds only


def test_without_lazy_connections_nothing_is_built_ahead():
    out = _run("full")
    assert out["prepared"] == out["start"] and out["switched"] > out["prepared"], out
