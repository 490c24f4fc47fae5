"""In-flight recovery (`recover-in-place`) with 4 real gloo ranks.

One rank dies (SIGKILL) or hangs; the others keep their processes and memory, only the
lost rank is started again and receives its state from live replicas; the final weights
equal the fault-free run's bit for bit, and no checkpoint is read.
"""

from __future__ import annotations

import os
from pathlib import Path
import subprocess
import sys

import pytest

from tests.conftest import EXAMPLE, free_port
from tests.integration.helpers import TRAIN_ARGS, assert_same_weights, events, reference_run, train

STEPS = 12
SHARDED = ["--optimizer", "sharded", "--num-replicas", "2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run(tmp_path_factory, steps=STEPS)


@pytest.fixture(scope="module")
def sharded_reference(tmp_path_factory):
    """The fault-free run with the replicated sharded optimizer (N = 2): its own weights."""
    return reference_run(tmp_path_factory, "sharded-reference", steps=STEPS, train_args=SHARDED)


def _survivor_pids(run_dir, replaced: set[int]) -> tuple[dict, dict]:
    """pids of the first start of every rank, and of the ranks at the end (last start per rank)."""
    first, last = {}, {}
    for e in events(run_dir, "rank_started"):
        first.setdefault(e["rank"], e["pid"])
        last[e["rank"]] = e["pid"]
    return ({r: p for r, p in first.items() if r not in replaced},
            {r: p for r, p in last.items() if r not in replaced})


def _check_in_flight(result, out, run_dir, reference, replaced: set[int]) -> dict:
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert_same_weights(reference, out)
    decisions = events(run_dir, "decision")
    assert decisions and all(d["rung"] == "recover-in-place" for d in decisions), decisions
    assert not events(run_dir, "attempt_started")[1:], "the job was restarted: not in flight"
    assert not events(run_dir, "restored"), "a checkpoint was read during an in-flight recovery"
    first, last = _survivor_pids(run_dir, replaced)
    assert first == last, "a survivor's process changed"
    (done,) = events(run_dir, "recovered_in_flight")[-1:]
    assert set(done["replaced"]) == replaced
    return done


@pytest.mark.timeout(300)  # with the reference run it compares with (the first user of it builds it)
@pytest.mark.parametrize("phase,optimizer", [
    # One in the default run (a kill at update with full replication); the others in the slow set
    # (`pytest -m slow`).
    pytest.param(phase, optimizer, marks=() if (phase, optimizer) in {("update", "full-replication")}
                 else pytest.mark.slow, id=f"{phase}-{optimizer}")
    for optimizer in ("full-replication", "sharded-n2") for phase in ("compute", "sync", "vote", "update")])
def test_sigkill_recovered_in_place_bit_exact(tmp_path, request, phase, optimizer):
    sharded = optimizer == "sharded-n2"
    reference = request.getfixturevalue("sharded_reference" if sharded else "reference")
    result, out, run_dir = train(tmp_path, f"kill-{phase}", steps=STEPS, train_args=SHARDED if sharded else [],
                                 flags=["--inject", f"kill:rank=2:step=7:at={phase}"])
    done = _check_in_flight(result, out, run_dir, reference, {2})
    # Killed after it passed step 7's commit ('update'): it rolls forward and step 8 is redone. Killed with its
    # reduction done, before its commit ('vote'): with the sharded optimizer the survivors pause in the vote
    # and step 7 rolls back; fully replicated, step 7 has no vote (worker/commit.py): the survivors update,
    # and the lost rank's state after compute comes from the file its agent read.
    assert done["resume_step"] == (8 if phase == "update" or (phase, optimizer) == ("vote", "full-replication")
                                   else 7)
    assert done["steps_redone"] == 0


@pytest.mark.slow  # a hang recovered in flight stays in the default run: test_hang_blame
@pytest.mark.timeout(200)
def test_hung_worker_killed_and_recovered_in_place(tmp_path, reference):
    result, out, run_dir = train(tmp_path, "hang", steps=STEPS, flags=["--inject", "hang:rank=1:step=8"])
    _check_in_flight(result, out, run_dir, reference, {1})
    (detected,) = events(run_dir, "hang_detected")
    assert detected["rank"] == 1


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_two_workers_in_different_blocks_killed_at_once_recovered_in_flight(tmp_path, sharded_reference):
    # N = 2 over 4 ranks: blocks {0, 1} and {2, 3}; rank 0 holds shard 0 (with rank 2),
    # rank 3 holds shard 1 (with rank 1): every shard keeps a live holder.
    result, out, run_dir = train(tmp_path, "two", steps=STEPS, train_args=SHARDED,
                                 flags=["--inject", "kill:rank=0:step=6,kill:rank=3:step=6"])
    _check_in_flight(result, out, run_dir, sharded_reference, {0, 3})


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_both_holders_of_a_shard_lost_falls_back_to_the_checkpoint(tmp_path, sharded_reference):
    # Ranks 0 and 2 both hold shard 0: no live replica, so the ladder falls to `exit`
    # and the job resumes from the newest checkpoint, with the steps lost reported.
    result, out, run_dir = train(tmp_path, "both", steps=STEPS, train_args=SHARDED, flags=[
        "--save", str(tmp_path / "ckpt"), "--ckpt-every-steps", "5",
        "--inject", "kill:rank=0:step=7,kill:rank=2:step=7"])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert_same_weights(sharded_reference, out)
    rungs = [d["rung"] for d in events(run_dir, "decision")]
    assert rungs[-1] == "exit", rungs
    assert "no live replica of optimizer shard 0" in events(run_dir, "decision")[-1]["reason"]
    (recovered,) = events(run_dir, "recovered")
    assert recovered["tier"] == "memory" and recovered["step"] - recovered["restored_step"] == 2  # steps lost


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_replacement_killed_while_restoring_is_recovered(tmp_path, reference):
    result, out, run_dir = train(tmp_path, "cascade", steps=STEPS,
                                 flags=["--inject", "kill:rank=2:step=5,kill:rank=2:step=5:at=restore"])
    _check_in_flight(result, out, run_dir, reference, {2})
    assert len(events(run_dir, "decision")) == 2  # the first recovery, then the cascade


@pytest.mark.timeout(200)
def test_node_summaries_keep_the_steady_reports_on_the_node_and_a_kill_recovers_in_flight(tmp_path,
                                                                                         tmp_path_factory):
    """--node-summaries (agent/held_reports.py): after a rank's first few steps its compute reports stay with
    its agent, which sends one summary a second (a group of one: agent/summary_tree.py); the killed rank's held
    reports (its own state at the step's start) go before its exit, and its replacement resumes in flight,
    bit-exact."""
    steps = 2 * STEPS  # long enough for the steady steps after the recovery to be held too
    reference = reference_run(tmp_path_factory, steps=steps)
    result, out, run_dir = train(tmp_path, "summaries", steps=steps,
                                 flags=["--node-summaries", "--inject", "kill:rank=2:step=9"],
                                 train_args=["--step-sleep-s", "0.05"])  # a summary or two a run
    _check_in_flight(result, out, run_dir, reference, {2})
    (exited,) = events(run_dir, "rank_exited")[:1]
    assert (exited["rank"], exited["step"]) == (2, 9)  # where it died, though its steps 4-8 were held
    (counts,) = events(run_dir, "control_messages")
    assert counts["relayed"]["Progress"] < 3 * steps, counts  # one a rank a step without summaries (4 x steps)
    assert counts["received"].get("GroupSummary", 0) >= 1, counts  # (a group of one node: its own)
    assert "Progress" not in counts["received"] and "StepSynced" not in counts["received"]
    assert events(run_dir, "step")[-1]["step"] == steps


def _two_agents(tmp_path, steps: int, flags: list[str], train_args: list[str] = ()) -> Path:
    """`unbroken run` on two agents on loopback, 2 ranks each, every flag on both; returns node 0's run dir."""
    port = free_port()
    env = dict(os.environ, UNBROKEN_JOB_SECRET="two-agents-secret-" + "t0123456789" * 2)
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "unbroken.cli.main", "run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "2", "--master-port", str(port), "--run-dir", str(tmp_path / f"node{node}"),
               *flags, str(EXAMPLE), "--steps", str(steps), "--out", str(tmp_path / "out.safetensors"),
               *TRAIN_ARGS, *train_args]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=200)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    return tmp_path / "node0"


@pytest.mark.timeout(240)
def test_a_rank_of_another_node_killed_after_its_reduction_resumes_from_the_state_it_sent_as_it_began(
        tmp_path, reference):
    """Two agents: node 1's ranks keep no file of their own state (a lost node takes it along), so in a
    vote-less step each sends its state as its reduction begins (SyncState), before any rank can update.
    Rank 3 killed with its reduction of step 5 done, before the step's end: its peers updated step 5, and
    its replacement resumes at step 6 from that state, in flight, bit-exact (the commit report it used to
    send after its reduction never left: the in-flight recovery was refused, the job restarted)."""
    run_dir = _two_agents(tmp_path, STEPS, ["--inject", "kill:rank=3:step=5:at=vote"])
    assert_same_weights(reference, tmp_path / "out.safetensors")
    (decision,) = events(run_dir, "decision")
    assert (decision["rank"], decision["rung"]) == (3, "recover-in-place"), decision
    assert len(events(run_dir, "attempt_started")) == 1
    assert events(run_dir, "recovered_in_flight")[0]["resume_step"] == 6
    (counts,) = events(run_dir, "control_messages")
    assert counts["received"].get("SyncState", 0) >= 2 * (STEPS - 3), counts  # node 1's ranks, vote-less steps


@pytest.mark.timeout(240)
def test_node_summaries_through_a_leader_agent_and_a_kill_on_the_member_node(tmp_path, tmp_path_factory):
    """Two agents on loopback, --node-summaries: node 1 sends its summaries to node 0's agent, which leads
    their group and sends the controller one GroupSummary a second (agent/summary_tree.py). A kill on node 1
    is recovered in flight, bit-exact: its held reports and its own-state file are on its live node."""
    steps = 2 * STEPS
    reference = reference_run(tmp_path_factory, steps=steps)
    run_dir = _two_agents(tmp_path, steps, ["--node-summaries", "--inject", "kill:rank=3:step=9"],
                          ["--step-sleep-s", "0.05"])
    assert_same_weights(reference, tmp_path / "out.safetensors")
    (decision,) = events(run_dir, "decision")
    assert (decision["rank"], decision["rung"]) == (3, "recover-in-place")
    assert len(events(run_dir, "attempt_started")) == 1
    (counts,) = events(run_dir, "control_messages")
    assert counts["received"].get("GroupSummary", 0) >= 1, counts
    assert "NodeSummary" not in counts["received"], counts  # node 1's went through node 0's agent
    assert counts["relayed"]["Progress"] < 3 * steps, counts


@pytest.mark.timeout(200)
def test_recover_onto_a_standby_agent_bit_exact(tmp_path, reference):
    """Rung `recover`: the lost rank starts again on a spare agent, not on its own node. Both
    agents relay their ranks' step reports (--node-reports, agent/relay.py): the replacement's go
    through the standby agent, and the commits go to both."""
    port = free_port()
    env = dict(os.environ, UNBROKEN_JOB_SECRET="standby-test-secret-" + "s" * 16)
    out = tmp_path / "standby.safetensors"
    script = [str(EXAMPLE), "--steps", str(STEPS), "--out", str(out), *TRAIN_ARGS]
    main = [sys.executable, "-m", "unbroken.cli.main", "run", "--nproc-per-node", "4", "--master-port", str(port),
            "--run-dir", str(tmp_path / "main"), "--recover-strategy", "recover,exit",
            "--inject", "kill:rank=2:step=7", "--node-reports", *script]
    spare = [sys.executable, "-m", "unbroken.cli.main", "run", "--standby", "--master-port", str(port),
             "--run-dir", str(tmp_path / "spare"), "--node-reports", *script]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd in (main, spare)]
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    run_dir = tmp_path / "main"
    assert_same_weights(reference, out)
    (decision,) = events(run_dir, "decision")
    assert decision["rung"] == "recover"
    (standby,) = events(run_dir, "standby_joined")
    (restart,) = events(run_dir, "restart_rank")
    assert restart["rank"] == 2 and restart["agent"] == standby["agent"]
    first, last = _survivor_pids(run_dir, {2})
    assert first == last
    assert events(run_dir, "recovered_in_flight")[0]["replaced"] == [2]
    (counts,) = events(run_dir, "control_messages")
    # every step report went through the agents (a vote-less step sends its compute report only)
    assert counts["relayed"]["Progress"] >= 4 * STEPS - 4 and "Progress" not in counts["received"]
    assert "StepSynced" not in counts["received"]
