"""Stock FSDP2 (`fully_shard`) under `unbroken run` on 4 real gloo ranks: HSDP in flight, pure FSDP from memory.

examples/train_fsdp.py shards the GPT over a DeviceMesh built after ``unbroken.init()`` (its groups
are SurvivingGroups). HSDP 2x2 (``--replicas 2``): rank r's parameter and optimizer shards are
also held by rank r +- 2; a rank killed (at compute, sync, update; rank 0) or stopped (SIGSTOP)
is replaced in flight, the survivors keep their processes, the replacement receives its local
shards from its peer in the other replica, no checkpoint is read, and the final weights equal
the fault-free run's bit for bit; so are two ranks killed at once in different replicas
holding different shards. Both holders of one shard killed, or pure FSDP (``--replicas 1``):
the lost shards have no other holder, so the job restarts from the memory tier, bit-exact from the restored step, and
the steps lost are reported. One case in the default run, the rest in the slow set.
"""

from __future__ import annotations

import sys

import pytest

from tests.conftest import REPO, run_cli
from tests.integration.helpers import (assert_same_weights, check_in_flight, check_trained_in_flight, events,
                                       run_and_sigstop)

FSDP_EXAMPLE = REPO / "examples" / "train_fsdp.py"
STEPS = 10
ARGS = ["--log-every", "1"]


def _train(tmp, name: str, *, replicas: int = 2, flags: list[str] = (), timeout_s: float = 300):
    out, run_dir = tmp / f"{name}.safetensors", tmp / f"run-{name}"
    args = ["run", "--nproc-per-node", "4", "--run-dir", str(run_dir), *flags, str(FSDP_EXAMPLE),
            "--steps", str(STEPS), "--out", str(out), "--replicas", str(replicas), *ARGS]
    return run_cli(args, timeout_s=timeout_s), out, run_dir


def _reference(tmp_path_factory, replicas: int):
    result, out, _ = _train(tmp_path_factory.mktemp(f"fsdp-reference-{replicas}"), "reference", replicas=replicas)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def hsdp_reference(tmp_path_factory):
    return _reference(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def fsdp_reference(tmp_path_factory):
    return _reference(tmp_path_factory, 1)


def _kill_case(tmp_path, reference, inject: str, replaced: set[int]) -> dict:
    return check_trained_in_flight(_train(tmp_path, "faulty", flags=["--inject", inject]), reference, replaced)


@pytest.mark.timeout(600)
def test_hsdp_rank_killed_mid_gradient_reduction_recovers_in_flight_bit_exact(tmp_path, hsdp_reference):
    done = _kill_case(tmp_path, hsdp_reference, "kill:rank=2:step=5:at=sync", {2})
    assert done["resume_step"] == 5  # not committed: the step is dropped and redone


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("inject,replaced,resume_step", [
    pytest.param("kill:rank=1:step=4", {1}, 4, id="compute"),
    pytest.param("kill:rank=3:step=6:at=update", {3}, 7, id="update"),  # committed: rolls forward
    pytest.param("kill:rank=0:step=5:at=sync", {0}, 5, id="rank0"),
    # ranks 1 and 2: different replicas holding different shards, so each shard keeps a live holder (3, 0)
    pytest.param("kill:rank=1:step=5:at=sync,kill:rank=2:step=5:at=sync", {1, 2}, 5, id="two-at-once"),
])
def test_hsdp_kills_recover_in_flight_bit_exact(tmp_path, hsdp_reference, inject, replaced, resume_step):
    done = _kill_case(tmp_path, hsdp_reference, inject, replaced)
    assert done["resume_step"] == resume_step


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hsdp_stopped_rank_is_replaced_in_flight_bit_exact(tmp_path, hsdp_reference):
    """SIGSTOP: gloo raises nothing, the survivors block in FSDP's collectives until the abort order."""
    out, run_dir = tmp_path / "stopped.safetensors", tmp_path / "run-stopped"
    cmd = [sys.executable, "-m", "unbroken.cli.main", "run", "--nproc-per-node", "4", "--run-dir", str(run_dir),
           str(FSDP_EXAMPLE), "--steps", str(STEPS), "--out", str(out), *ARGS, "--step-sleep-s", "0.2"]
    returncode, output = run_and_sigstop(cmd, run_dir, rank=2, after_step=4, start_s=300, finish_s=300)
    check_in_flight(returncode, output, run_dir, {2})
    assert [d["rank"] for d in events(run_dir, "hang_detected")] == [2]
    assert_same_weights(hsdp_reference, out)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pure_fsdp_kill_restarts_from_the_memory_tier_bit_exact(tmp_path, fsdp_reference):
    """No replicate dimension: rank 2's shards have no other holder, so no in-flight rung is feasible."""
    result, out, run_dir = _train(tmp_path, "kill", replicas=1, flags=[
        "--save", str(tmp_path / "ckpt"), "--ckpt-every-steps", "5", "--inject", "kill:rank=2:step=7"])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert_same_weights(fsdp_reference, out)
    (decision,) = events(run_dir, "decision")
    assert decision["rung"] == "exit" and "no live replica" in decision["reason"], decision
    restored = events(run_dir, "restored")
    assert {(e["step"], e["tier"]) for e in restored} == {(5, "memory")} and len(restored) == 4
    (recovered,) = events(run_dir, "recovered")
    assert recovered["step"] == 7 and recovered["restored_step"] == 5  # 2 steps lost, reported


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hsdp_both_holders_of_a_shard_killed_restart_from_the_memory_tier_bit_exact(tmp_path, hsdp_reference):
    """Ranks 0 and 2 hold the same shards (one per replica): killed together, those shards have no
    live holder left, so the job restarts from the memory tier, bit-exact, the steps lost reported."""
    result, out, run_dir = _train(tmp_path, "kill", flags=[
        "--save", str(tmp_path / "ckpt"), "--ckpt-every-steps", "5",
        "--inject", "kill:rank=0:step=7,kill:rank=2:step=7"])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert_same_weights(hsdp_reference, out)
    # The controller may see one death first (its shards still have a holder: in place), then the
    # other: the last decision is the job restart, naming the shard with no holder left.
    decision = events(run_dir, "decision")[-1]
    assert decision["rung"] == "exit" and "holders [0, 2] all lost" in decision["reason"], decision
    restored = events(run_dir, "restored")
    assert {(e["step"], e["tier"]) for e in restored} == {(5, "memory")} and len(restored) == 4
    (recovered,) = events(run_dir, "recovered")
    assert recovered["step"] == 7 and recovered["restored_step"] == 5  # 2 steps lost, reported
