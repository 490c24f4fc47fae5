"""PP2 x DP2 with the distributed optimizer inside dp (examples/train_3d.py --sharded-optimizer N).

A ShardedOptimizer on the mesh's dp group (4 real gloo ranks under `unbroken run`): with N = 2
every dp rank is its own block (each optimizer shard held twice), so a rank killed at update is
replaced in flight: its stage's parameters come from its dp replica, its optimizer shard from the
rank holding the same shard (same pp coordinate, same shard index inside dp), over the dp group
that survives the regroup. With N = 1 (no replica of a shard) the controller finds no live holder
of the lost rank's optimizer shard and the job restarts from the memory tier. Both end bit-equal to
the fault-free N = 2 run (the optimizer's buckets and shard boundaries do not depend on N). Slow:
each job takes 1-2 minutes (PP2 x DP4 on 8 ranks: 1.5-3) on the loaded 2-core machine; the layout questions are answered in the
default run by tests/parallel/test_mesh_map.py and tests/controller/test_machine_mesh.py.
"""

from __future__ import annotations

import pytest

from tests.conftest import REPO, run_cli
from tests.integration.helpers import assert_same_weights, check_in_flight, events
from tests.integration.test_pipeline_in_flight import (CKPT, _check_restarted_from_memory, _rank_file, _train,
                                                    assert_same_stages)

pytestmark = pytest.mark.slow


def _sharded(n: int) -> list[str]:
    return ["--sharded-optimizer", str(n)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    result, out, _ = _train(tmp_path_factory.mktemp("sharded-reference"), "reference", script=_sharded(2))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


@pytest.mark.timeout(600)
def test_rank_killed_at_update_gets_its_stage_and_optimizer_shard_in_flight_bit_exact(tmp_path, reference):
    result, out, run_dir = _train(tmp_path, "faulty", script=_sharded(2),
                                  flags=["--inject", "kill:rank=3:step=5:at=update"])
    done = check_in_flight(result.returncode, result.stdout + result.stderr, run_dir, {3})
    assert done["resume_step"] == 6  # committed at update: the survivors went on to step 6
    roles = {e["role"] for e in events(run_dir, "restore_phases")}
    assert roles == {"replacement", "survivor"}, roles
    assert_same_stages(reference, out)


@pytest.mark.timeout(900)
def test_no_replica_of_the_optimizer_shard_falls_to_the_memory_tier_bit_exact(tmp_path, reference):
    """N = 1: rank 2's stage has a live dp replica (rank 3) but its optimizer shard has none."""
    result, out, run_dir = _train(tmp_path, "alone", script=_sharded(1),
                                  flags=["--save", str(tmp_path / "ckpt"), *CKPT, "--inject", "kill:rank=2:step=5"])
    recovered = _check_restarted_from_memory(result, run_dir, "no live replica of optimizer shard 0 of pp=1, tp=0 "
                                                              "of rank 2 (holders [2] all lost)")
    assert (recovered["step"], recovered["restored_step"]) == (5, 4)
    assert_same_stages(reference, out)


def _train8(tmp, name: str, flags: list[str] = ()):
    out, run_dir = tmp / f"{name}.safetensors", tmp / f"run-{name}"
    args = ["run", "--nproc-per-node", "8", "--run-dir", str(run_dir), *flags,
            str(REPO / "tests" / "integration" / "scripts" / "pipeline_script.py"), "--steps", "8", "--out", str(out),
            "--pp", "2", "--dp", "4", "--microbatches", "4", "--log-every", "1", *_sharded(2)]
    return run_cli(args, timeout_s=600), out, run_dir


@pytest.mark.timeout(1200)
def test_pp2_dp4_two_blocks_rank_killed_at_update_recovered_in_flight_bit_exact(tmp_path):
    """8 ranks, N = 2: dp blocks {0, 1} and {2, 3} of each stage, gathers inside a block. Rank 5 (pp=1,
    dp=1: shard 1) gets its stage from rank 4 and its optimizer shard from rank 7 (dp=3, shard 1)."""
    result, reference, _ = _train8(tmp_path, "reference")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    result, out, run_dir = _train8(tmp_path, "faulty", ["--inject", "kill:rank=5:step=5:at=update"])
    done = check_in_flight(result.returncode, result.stdout + result.stderr, run_dir, {5})
    assert done["resume_step"] == 6
    for rank in range(8):
        assert_same_weights(_rank_file(reference, rank), _rank_file(out, rank))
