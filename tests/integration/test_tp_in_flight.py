"""Tensor parallelism (DTensor, examples/train_3d.py --tp) on real gloo ranks under `unbroken run`.

DP2 x TP2 (4 ranks): each block's q/k/v and MLP input Linear are sharded by output feature and
the output projections by input feature over the mesh's tp group (a SurvivingGroup), so every
forward and backward runs all-reduces inside the tp group; the local shards' gradients are
all-reduced over the dp group. A rank killed in the middle of those collectives (in the backward
of a micro-batch), at compute, at update, rank 0, or stopped (SIGSTOP): the survivors keep their
processes and leave the tp/dp collectives promptly, the step is dropped and redone (rolled forward
from update), the replacement gets its own tp shard from its dp replica (the rank with its tp
coordinate in the other dp slice), no checkpoint is read, and every rank's final local shards equal
the fault-free run's bit for bit. PP2 x DP2 x TP2 (8 ranks): one kill, the same. PP2 x TP2 (dp = 1):
no replica, a kill falls to the memory tier. One case in the default run, the rest slow.
"""

from __future__ import annotations

import sys

import pytest

from tests.conftest import REPO, run_cli
from tests.integration.helpers import assert_same_weights, check_in_flight, events, run_and_sigstop

SCRIPT = REPO / "tests" / "integration" / "scripts" / "pipeline_script.py"
STEPS = 6
DP2_TP2 = ["--pp", "1", "--dp", "2", "--tp", "2", "--microbatches", "2", "--log-every", "1"]
# A DTensor job's first step is slow (DTensor's first dispatches: ~1-7 s quiet), and on 2 loaded cores
# it passed the default 60 s floor of the hang detector before a first step: a "hang", a job restart.
FIRST_STEP = ["--first-step-timeout-s", "300"]


def _train(tmp, name: str, *, layout: list[str] = DP2_TP2, nproc: int = 4, flags: list[str] = (),
           script: list[str] = (), timeout_s: float = 400):
    out, run_dir = tmp / f"{name}.safetensors", tmp / f"run-{name}"
    args = ["run", "--nproc-per-node", str(nproc), "--run-dir", str(run_dir), *FIRST_STEP, *flags, str(SCRIPT),
            "--steps", str(STEPS), "--out", str(out), *layout, *script]
    return run_cli(args, timeout_s=timeout_s), out, run_dir


def _rank_file(out, rank: int):
    return out.with_name(f"{out.stem}.rank{rank}{out.suffix}")


def assert_same_shards(reference, out, nproc: int = 4) -> None:
    for rank in range(nproc):
        assert_same_weights(_rank_file(reference, rank), _rank_file(out, rank))


def _reference(tmp, layout: list[str] = DP2_TP2, nproc: int = 4, timeout_s: float = 400):
    tmp.mkdir(parents=True, exist_ok=True)
    result, out, _ = _train(tmp, "reference", layout=layout, nproc=nproc, timeout_s=timeout_s)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _reference(tmp_path_factory.mktemp("tp-reference"))


def _case(tmp_path, reference, *, flags=(), script=(), replaced: set[int]) -> dict:
    result, out, run_dir = _train(tmp_path, "faulty", flags=list(flags), script=list(script))
    done = check_in_flight(result.returncode, result.stdout + result.stderr, run_dir, replaced)
    assert_same_shards(reference, out)
    return done


@pytest.mark.timeout(600)
def test_tp_rank_killed_inside_the_tp_collectives_recovers_in_flight_bit_exact(tmp_path, reference):
    """Rank 1 (dp=0, tp=1) dies at the end of micro-batch 0's backward of step 3: its tp peer rank 0
    waits on it in micro-batch 1's first tp all-reduce, rank 3 in the dp all-reduce; rank 1's shard
    comes from rank 3 (dp=1, tp=1)."""
    done = _case(tmp_path, reference, script=["--kill-in-schedule", "1:3:0"], replaced={1})
    assert done["resume_step"] == 3  # not committed: dropped on every rank and redone


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("flags,replaced,resume_step", [
    pytest.param(["--inject", "kill:rank=2:step=2"], {2}, 2, id="compute"),
    pytest.param(["--inject", "kill:rank=3:step=4:at=update"], {3}, 5, id="update"),  # committed: forward
    pytest.param(["--inject", "kill:rank=0:step=3"], {0}, 3, id="rank0"),
])
def test_tp_kills_recover_in_flight_bit_exact(tmp_path, reference, flags, replaced, resume_step):
    done = _case(tmp_path, reference, flags=flags, replaced=replaced)
    assert done["resume_step"] == resume_step


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_stopped_tp_rank_is_replaced_in_flight_bit_exact(tmp_path, reference):
    """SIGSTOP: gloo raises nothing; the tp peer and the dp replicas block until the abort order."""
    out, run_dir = tmp_path / "stopped.safetensors", tmp_path / "run-stopped"
    cmd = [sys.executable, "-m", "unbroken.cli.main", "run", "--nproc-per-node", "4", "--run-dir", str(run_dir),
           *FIRST_STEP, str(SCRIPT), "--steps", str(STEPS), "--out", str(out), *DP2_TP2, "--step-sleep-s", "0.2"]
    returncode, output = run_and_sigstop(cmd, run_dir, rank=3, after_step=2, start_s=300, finish_s=300)
    check_in_flight(returncode, output, run_dir, {3})
    assert [d["rank"] for d in events(run_dir, "hang_detected")] == [3]
    assert_same_shards(reference, out)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # two 8-rank runs on 2 cores
def test_pp2_dp2_tp2_on_8_ranks_recovers_in_flight_bit_exact(tmp_path):
    """8 ranks: rank 5 (pp=1, dp=0, tp=1) dies mid-schedule (its tp peer rank 4 waits on it in a tp
    all-reduce, stage 0 on its gradients); its stage's tp shard comes from rank 7 (dp=1)."""
    layout = ["--pp", "2", "--dp", "2", "--tp", "2", "--microbatches", "2", "--log-every", "1"]
    reference = _reference(tmp_path / "reference", layout=layout, nproc=8, timeout_s=500)
    result, out, run_dir = _train(tmp_path, "faulty", layout=layout, nproc=8, script=["--kill-in-schedule", "5:3:0"],
                                  timeout_s=600)
    done = check_in_flight(result.returncode, result.stdout + result.stderr, run_dir, {5})
    assert done["resume_step"] == 3
    assert_same_shards(reference, out, nproc=8)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pp2_tp2_without_replicas_falls_to_the_memory_tier_bit_exact(tmp_path):
    """dp = 1: no rank holds a second copy of any (pp, tp) shard; a kill restarts the job from the
    memory tier, every rank restores the newest step, and the step lost is reported."""
    layout = ["--pp", "2", "--dp", "1", "--tp", "2", "--microbatches", "2", "--log-every", "1"]
    reference = _reference(tmp_path / "reference", layout=layout)
    result, out, run_dir = _train(tmp_path, "pp2tp2", layout=layout, flags=[
        "--save", str(tmp_path / "ckpt"), "--ckpt-every-steps", "2", "--inject", "kill:rank=2:step=5"])
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    exits = [d for d in events(run_dir, "decision") if d["rung"] == "exit"]
    assert len(exits) == 1 and "no live replica of the state of pp=1, tp=0 of rank 2" in exits[0]["reason"], exits
    restored = events(run_dir, "restored")
    assert {e["tier"] for e in restored} == {"memory"} and len(restored) == 4, restored
    (recovered,) = events(run_dir, "recovered")
    # the newest memory snapshot every rank had committed when the kill hit: step 4's, or on a loaded machine
    # still step 2's (step 4's copy in flight at step 5); the steps since are redone, the weights still exact
    assert recovered["step"] == 5 and recovered["restored_step"] in (2, 4), recovered
    assert_same_shards(reference, out)
