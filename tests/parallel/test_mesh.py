"""The job's mesh (unbroken.parallel.mesh) on 4 real gloo processes: pp=2 x dp=2 x tp=1.

Every sub-group torch's DeviceMesh creates is one of the fabric's SurvivingGroups; each is
warmed and correct at generation 0, stays the same object when the fabric moves to generation
1, and a replacement process that builds its mesh while the survivors switch joins all of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.conftest import REPO, free_port

WORKER = Path(__file__).with_name("mesh_worker.py")
# ranks: 0 = (pp0, dp0), 1 = (pp0, dp1), 2 = (pp1, dp0), 3 = (pp1, dp1)
GROUPS = {"pp": {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]},
          "dp": {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]},
          "tp": {r: [r] for r in range(4)}}


def _start(rank: int, port: int, out: Path, gen: int, survive: bool) -> subprocess.Popen:
    cmd = [sys.executable, str(WORKER), "--rank", str(rank), "--world", "4", "--port", str(port), "--gen", str(gen),
           "--out", str(out)] + (["--survive"] if survive else [])
    log = open(out / f"rank{rank}.gen{gen}.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"))


def _wait(procs: list[subprocess.Popen], out: Path) -> None:
    try:
        for p in procs:
            p.wait(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = "\n".join(f"--- {f.name}\n{f.read_text()[-2000:]}" for f in sorted(out.glob("*.log")))
    assert all(p.returncode == 0 for p in procs), logs


@pytest.mark.timeout(300)
def test_mesh_groups_survive_a_generation_and_a_replacement_builds_its_mesh_while_the_others_switch(tmp_path):
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    # Generation 0: all four; rank 3 then leaves (as a lost rank), ranks 0-2 go on to generation 1.
    first = [_start(r, port, tmp_path, 0, survive=r != 3) for r in range(4)]
    first[3].wait(timeout=120)
    replacement = _start(3, port, tmp_path, 1, survive=False)
    _wait(first + [replacement], tmp_path)
    facts = {(r, g): json.loads((tmp_path / f"rank{r}.gen{g}.json").read_text())
             for r, g in [(0, 0), (1, 0), (2, 0), (3, 0), (3, 1)]}
    for (rank, first_gen), f in facts.items():
        assert f["surviving"] == {"pp": True, "dp": True, "tp": True}
        assert f["coords"] == {"pp": rank // 2, "dp": rank % 2, "tp": 0}
        assert f["replicas"] == GROUPS["dp"][rank]  # its state's holders: its dp group
        for name in ("pp", "dp", "tp"):
            assert f["group_ranks"][name] == GROUPS[name][rank]
            for gen, sums in f["sums"].items():
                assert sums[name] == sum(r + 1 for r in GROUPS[name][rank]), (rank, gen, name)
    for rank in (0, 1, 2):  # survivors: the same group objects, moved to generation 1
        f = facts[(rank, 0)]
        assert f["group_ids"]["0"] == f["group_ids"]["1"]
        assert f["generations"] == {"0": {"pp": 0, "dp": 0, "tp": 0}, "1": {"pp": 1, "dp": 1, "tp": 1}}
    assert facts[(3, 1)]["generations"] == {"1": {"pp": 1, "dp": 1, "tp": 1}}
    del store


class _Schedule:
    """The attributes of a torch 2.13 single-stage schedule that JobMesh touches."""

    def __init__(self) -> None:
        self._stage_forward_initialized = self._stage_backward_initialized = True
        self._internal_losses = ["a partial micro-batch loss"]


def test_registered_schedules_warm_up_again_after_a_regroup_and_drop_partial_losses():
    from unbroken.parallel.mesh import JobMesh
    from unbroken.recovery.mesh_map import MeshReplicaMap

    mesh = JobMesh(None, MeshReplicaMap((("pp", 2), ("dp", 2), ("tp", 1))), rank=2)
    schedule = mesh.pipeline(_Schedule())
    assert (mesh.coord("pp"), mesh.coord("dp"), mesh.group_ranks("dp")) == (1, 0, [2, 3])
    mesh.after_regroup()
    assert not schedule._stage_forward_initialized and not schedule._stage_backward_initialized
    assert schedule._internal_losses == []


def test_pipeline_refuses_what_is_not_a_single_stage_schedule():
    from unbroken.errors import ConfigError
    from unbroken.parallel.mesh import JobMesh
    from unbroken.recovery.mesh_map import MeshReplicaMap

    mesh = JobMesh(None, MeshReplicaMap((("pp", 2), ("dp", 2))), rank=0)
    with pytest.raises(ConfigError, match="a object has no .*_stage_forward_initialized.*ScheduleGPipe"):
        mesh.pipeline(object())
    with pytest.raises(ConfigError, match="'tp' is not a dimension of the job's mesh"):
        mesh.coord("tp")
