"""Stock DistributedDataParallel recovered in flight under `unbroken run` (4 real gloo ranks).

examples/train_ddp.py keeps ``DistributedDataParallel(model)`` on the default group (a
SurvivingGroup under `unbroken run`) with ``no_sync()`` gradient accumulation. A rank is
killed (at compute, sync, update; rank 0; two at once) or stopped (SIGSTOP): the survivors keep
their processes and leave the broken all-reduce, only the lost ranks start again and receive
their state from a live replica, no checkpoint is read, and the final weights equal the
fault-free run's bit for bit. The real-scripts script covers a BatchNorm layer (running
statistics, ``broadcast_buffers``) with per-rank seeds and a sampler, and DDP's
``find_unused_parameters`` and ``static_graph``. One case in the default run, the rest in the slow set.
"""

from __future__ import annotations

import sys

import pytest

from tests.conftest import REPO, run_cli
from tests.integration.helpers import (assert_same_weights, check_in_flight, check_trained_in_flight, events,
                                       run_and_sigstop)
from tests.integration.real_scripts import assert_same_state, run_real

DDP_EXAMPLE = REPO / "examples" / "train_ddp.py"
STEPS = 10
ARGS = ["--grad-accum", "2", "--log-every", "1"]


def _train(tmp, name: str, *, flags: list[str] = (), steps: int = STEPS, timeout_s: float = 240):
    out, run_dir = tmp / f"{name}.safetensors", tmp / f"run-{name}"
    args = ["run", "--nproc-per-node", "4", "--run-dir", str(run_dir), *flags, str(DDP_EXAMPLE),
            "--steps", str(steps), "--out", str(out), *ARGS]
    return run_cli(args, timeout_s=timeout_s), out, run_dir


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    result, out, _ = _train(tmp_path_factory.mktemp("ddp-in-flight-reference"), "reference")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def _kill_case(tmp_path, reference, inject: str, replaced: set[int]) -> dict:
    return check_trained_in_flight(_train(tmp_path, "faulty", flags=["--inject", inject]), reference, replaced)


@pytest.mark.timeout(600)
def test_ddp_rank_killed_mid_all_reduce_recovers_in_flight_bit_exact(tmp_path, reference):
    done = _kill_case(tmp_path, reference, "kill:rank=2:step=5:at=sync", {2})
    assert done["resume_step"] == 5  # not committed: the step is dropped and redone


@pytest.mark.timeout(600)
def test_ddp_rank_killed_before_its_commit_report_resumes_from_the_state_its_agent_read(tmp_path, reference):
    """Killed with its reduction of step 5 done, before its commit report (with its own state after
    compute) left. Step 5 needs no vote (worker/commit.py): the survivors update and go on, so step 5
    committed; the lost rank's own state comes from the file it kept in node memory, which its agent
    read when it died (checkpoint/own_state.py): in flight, resumed at step 6, bit-exact."""
    trained = _train(tmp_path, "faulty", flags=["--inject", "kill:rank=1:step=5:at=vote"])
    done = check_trained_in_flight(trained, reference, {1})
    assert done["resume_step"] == 6
    (exited,) = [e for e in events(trained[2], "rank_exited") if e["rank"] == 1 and e["signal"]]
    assert exited["own_state_of_step"] == 5


@pytest.mark.timeout(600)
def test_ddp_rank_killed_before_the_commit_vote_leaves_the_survivors_paused_in_it(tmp_path, reference):
    """A generation's first step votes: rank 2 killed inside the reduction of step 3 (redone in
    generation 1), then rank 1 killed with its reduction of that step done, just before it joined the
    commit vote: every survivor waits in the vote, pauses there with its gradients whole and learns
    the decision (nobody passed the vote: step 3 is redone); every rank ends on the fault-free weights."""
    done = _kill_case(tmp_path, reference, "kill:rank=2:step=3:at=sync,kill:rank=1:step=3:at=vote", {1, 2})
    assert done["resume_step"] == 3


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("inject,replaced,resume_step", [
    pytest.param("kill:rank=1:step=4", {1}, 4, id="compute"),
    pytest.param("kill:rank=3:step=6:at=update", {3}, 7, id="update"),  # committed: rolls forward
    pytest.param("hang:rank=2:step=6:at=vote", {2}, 7, id="hung-before-vote"),  # behind the others: blamed
    pytest.param("kill:rank=0:step=3:at=vote,kill:rank=3:step=7:at=vote", {0, 3}, None, id="two-votes"),
    pytest.param("kill:rank=0:step=5:at=sync", {0}, 5, id="rank0"),
    pytest.param("kill:rank=1:step=5:at=sync,kill:rank=2:step=5:at=sync", {1, 2}, 5, id="two-at-once"),
])
def test_ddp_kills_recover_in_flight_bit_exact(tmp_path, reference, inject, replaced, resume_step):
    done = _kill_case(tmp_path, reference, inject, replaced)
    assert resume_step is None or done["resume_step"] == resume_step


@pytest.mark.timeout(600)
@pytest.mark.parametrize("inject,replaced,resume_step", [
    pytest.param("kill:rank=1:step=7:at=vote", {1}, 8, id="vote"),  # the default run's representative
    pytest.param("kill:rank=1:step=7", {1}, 7, id="compute", marks=pytest.mark.slow),
    pytest.param("kill:rank=3:step=7:at=update", {3}, 8, id="update", marks=pytest.mark.slow),
    pytest.param("hang:rank=2:step=7:at=vote", {2}, 8, id="hung-before-vote", marks=pytest.mark.slow),
    pytest.param("kill:rank=0:step=7:at=sync", {0}, 7, id="rank0", marks=pytest.mark.slow),
])
def test_ddp_with_node_summaries_recovers_in_flight_bit_exact(tmp_path, reference, inject, replaced, resume_step):
    """--node-summaries (agent/held_reports.py): from step 4 the ranks' compute reports stay with their agent;
    the faults at step 7 find the lost rank's own state in the held reports (a step's start) or its file (after
    its reduction), the hang blamed on the reports its agent sends when asked."""
    trained = _train(tmp_path, "faulty", flags=["--node-summaries", "--inject", inject])
    done = check_trained_in_flight(trained, reference, replaced)
    assert done["resume_step"] == resume_step


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ddp_stopped_rank_is_replaced_in_flight_bit_exact(tmp_path, reference):
    """SIGSTOP: gloo raises nothing, the survivors block in DDP's all-reduce until the abort order."""
    out, run_dir = tmp_path / "stopped.safetensors", tmp_path / "run-stopped"
    cmd = [sys.executable, "-m", "unbroken.cli.main", "run", "--nproc-per-node", "4", "--run-dir", str(run_dir),
           str(DDP_EXAMPLE), "--steps", str(STEPS), "--out", str(out), *ARGS, "--step-sleep-s", "0.2"]
    returncode, output = run_and_sigstop(cmd, run_dir, rank=2, after_step=4, start_s=300, finish_s=300)
    check_in_flight(returncode, output, run_dir, {2})
    assert [d["rank"] for d in events(run_dir, "hang_detected")] == [2]
    assert_same_weights(reference, out)


BN_SCRIPT = ["--wrapper", "ddp", "--batchnorm", "--per-rank-seed", "--data", "sampler"]


@pytest.fixture(scope="module")
def bn_reference(tmp_path_factory):
    result, out, _ = run_real(tmp_path_factory.mktemp("ddp-bn-reference"), "reference", steps=STEPS,
                              script_args=BN_SCRIPT, timeout_s=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("killed", [0, 2], ids=["rank0-its-statistics-are-broadcast", "rank2-rank0-rolls-back"])
def test_ddp_batchnorm_statistics_recovered_in_flight_bit_exact(tmp_path, bn_reference, killed):
    """BatchNorm's running statistics move in every forward and DDP broadcasts rank 0's: a dropped
    step must put them back on every survivor, and a replaced rank 0 must get its own."""
    result, out, run_dir = run_real(tmp_path, "kill", steps=STEPS, script_args=BN_SCRIPT, timeout_s=240,
                                    flags=["--inject", f"kill:rank={killed}:step=5:at=sync"])
    check_in_flight(result.returncode, result.stdout + result.stderr, run_dir, {killed})
    assert_same_state(bn_reference, out)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("option", ["--find-unused", "--static-graph"])
def test_ddp_options_recovered_in_flight_bit_exact(tmp_path, option):
    """``find_unused_parameters=True`` (a layer unused on two steps of three: DDP walks the graph each
    forward and reduces the used ones; step 5 skips the layer, its redo must too) and
    ``static_graph=True`` (DDP's reducer remembers the first iteration's graph): a rank killed in
    DDP's all-reduce is replaced in flight, the state equals the fault-free run's bit for bit."""
    script = ["--wrapper", "ddp", "--data", "step", option]
    reference, ref_out, _ = run_real(tmp_path, "reference", steps=STEPS, script_args=script, timeout_s=240)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    result, out, run_dir = run_real(tmp_path, "kill", steps=STEPS, script_args=script, timeout_s=240,
                                    flags=["--inject", "kill:rank=2:step=5:at=sync"])
    done = check_in_flight(result.returncode, result.stdout + result.stderr, run_dir, {2})
    assert done["resume_step"] == 5
    assert_same_state(ref_out, out)
