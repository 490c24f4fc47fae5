"""Rung `elastic` across real network namespaces: a non-controller node is lost (killed, frozen, cut
off) and no standby waits, so the job goes on on the nodes left (controller/elastic.py).

Three nodes of one rank each, node 1 (the middle one: the ranks after it are renumbered) is hit after
step 4. The survivors restart at world 2 from their own memory-tier snapshots; in exact mode (the
default) rank 0 also runs the lost rank's micro-batch, so the global batch and the sample order are the
fault-free run's.

With the example's ``--exact-reduce`` (gradients summed in data-rank order, job.sum_over_data_ranks) the
final weights are the fault-free 3-rank run's bit for bit. With a plain all-reduce they may differ in the
last bits: the fault-free run sums g0 + g1 + g2 in gloo's all-reduce of three ranks, the shrunk one
g0 + g1 by autograd's accumulation on rank 0, then + g2 in a two-rank all-reduce, and floating-point
addition is not associative; there the test asserts a largest relative difference
(tests/integration/helpers.py max_rel_diff) of at most 1e-6 and prints it.

Scale-out: node 1's agent started again on its host after the kill; the job grows back to world 3 at a
committed step (rank 1 fetches a survivor's snapshot from its node's memory) and still ends bit-equal.
"""

from __future__ import annotations

import time

import pytest

from tests.integration.helpers import events, max_rel_diff, reference_run
from tests.netns.job import NetnsJob
from tests.netns.test_node_faults import NODE_TIMEOUT_S, SLOW, _alive

STEPS = 16
NPROC, NNODES = 1, 3
BOUND = 1e-6  # the largest relative difference of the final weights exact mode may show (see the docstring)


def flags(tmp_path, *more: str) -> list[str]:
    return ["--recover-strategy", "elastic,exit", "--node-reports", "--node-timeout-s", str(NODE_TIMEOUT_S),
            "--first-step-timeout-s", "300", "--save", str(tmp_path / "save"), "--ckpt-every-steps", "1", *more]


EXACT_REDUCE = ("--exact-reduce",)
# A first step may take minutes on a loaded 2-core machine; the hang rule must not restart the reference.
REFERENCE_FLAGS = ["--first-step-timeout-s", "300"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The fault-free run, gradients summed in data-rank order (--exact-reduce)."""
    return reference_run(tmp_path_factory, steps=STEPS, nproc=NPROC * NNODES, train_args=list(EXACT_REDUCE),
                         flags=REFERENCE_FLAGS, timeout_s=400)


@pytest.fixture(scope="module")
def reference_all_reduce(tmp_path_factory):
    return reference_run(tmp_path_factory, steps=STEPS, nproc=NPROC * NNODES, flags=REFERENCE_FLAGS, timeout_s=400)


def run_with_fault(netns_hosts, tmp_path, fault: str, job_flags: list[str],
                   train_args: tuple[str, ...] = EXACT_REDUCE):
    """Start the job, hit node 1 with ``fault`` after step 4; (job, time.time() of the fault)."""
    hosts = netns_hosts(NNODES)
    job = NetnsJob(hosts, tmp_path, nnodes=NNODES, nproc=NPROC, steps=STEPS, train_args=[*SLOW, *train_args],
                   flags=job_flags)
    job.wait_step(0, 4, timeout_s=360)
    victims = [e["pid"] for e in events(job.run_dir, "rank_started") if e["rank"] == 1]
    assert len(victims) == 1, events(job.run_dir)
    fault_t = time.time()
    getattr(hosts[1], fault)()
    if fault == "freeze":
        job.wait_for(lambda: events(job.run_dir, "attempt_started")[1:], 120, "the restart on the nodes left")
        hosts[1].thaw()  # it wakes after the job went on without it: its agent and workers leave
    return job, fault_t


def check_shrunk(job: NetnsJob, reference, *, mode: str = "exact") -> float:
    """Exit 0 on the nodes left, one elastic decision, a restart at world 2 from the memory tier; the
    final weights' largest relative difference against the fault-free run (0.0: bit-equal)."""
    codes = job.finish(240, [job.agents[0], job.agents[2]])
    assert codes == [0, 0], job.outputs()
    decisions = events(job.run_dir, "decision")
    assert [(d["rung"], d["kind"]) for d in decisions] == [("elastic", "node-lost")], decisions
    attempts = events(job.run_dir, "attempt_started")
    assert [a["attempt"] for a in attempts] == [0, 1], attempts
    started = [(e["rank"], e["attempt"]) for e in events(job.run_dir, "rank_started")]
    assert sorted(r for r, a in started if a == 1) == [0, 1], started  # world 2
    restored = [e for e in events(job.run_dir, "restored")]
    assert sorted((e["rank"], e["tier"], e["from_rank"]) for e in restored) == [(0, "memory", 0), (1, "memory", 2)]
    assert restored[0]["step"] >= 3, restored  # the newest snapshot, not a fresh start
    assert not events(job.run_dir, "persist_failed")  # storage steps after the shrink commit at world 2
    (recovered,) = events(job.run_dir, "recovered")
    assert recovered["attempt"] == 1 and recovered["tier"] == "memory", recovered
    diff = max_rel_diff(job.out, reference)
    print(f"elastic {mode}: resumed at step {restored[0]['step']}, final weights max relative difference "
          f"{diff:.3g} against the fault-free run ({'bit-equal' if diff == 0 else 'not bit-equal'})")
    return diff


@pytest.mark.timeout(600)
def test_a_killed_node_without_a_standby_the_job_goes_on_smaller_bit_exact(netns_hosts, tmp_path, reference):
    job, _ = run_with_fault(netns_hosts, tmp_path, "kill", flags(tmp_path))
    assert check_shrunk(job, reference) == 0.0
    assert not events(job.run_dir, "agent_silent")  # a dead node closes its connections: lost at once


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_with_a_plain_all_reduce_the_weights_differ_by_the_order_of_additions_only(
        netns_hosts, tmp_path, reference_all_reduce):
    job, _ = run_with_fault(netns_hosts, tmp_path, "kill", flags(tmp_path), train_args=())
    assert check_shrunk(job, reference_all_reduce) <= BOUND


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_frozen_node_is_lost_by_silence_and_the_job_goes_on_smaller(netns_hosts, tmp_path, reference):
    job, fault_t = run_with_fault(netns_hosts, tmp_path, "freeze", flags(tmp_path))
    assert check_shrunk(job, reference) == 0.0
    (silent,) = events(job.run_dir, "agent_silent")
    assert silent["node_rank"] == 1 and silent["t"] - fault_t < NODE_TIMEOUT_S + 10
    assert job.agents[1].wait(90) not in (0, None), job.outputs()  # it woke up to a job that went on
    assert not _alive(job.hosts[1].pids())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_cut_off_node_fences_itself_and_the_job_goes_on_smaller(netns_hosts, tmp_path, reference):
    job, _ = run_with_fault(netns_hosts, tmp_path, "cut", flags(tmp_path))
    assert job.agents[1].wait(60) == 1
    assert "fenced: no message from the controller" in job.agents[1].output()
    job.hosts[1].restore()
    assert check_shrunk(job, reference) == 0.0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fast_mode_trains_on_a_smaller_global_batch_with_the_lr_rule(netns_hosts, tmp_path, reference_all_reduce):
    job, _ = run_with_fault(netns_hosts, tmp_path, "kill",
                            flags(tmp_path, "--elastic-mode", "fast", "--elastic-lr-scaling", "linear"), train_args=())
    diff = check_shrunk(job, reference_all_reduce, mode="fast")
    assert diff > BOUND  # a different global batch and LR: other weights, by design
    assert "a smaller global batch (--elastic-mode fast)" in events(job.run_dir, "decision")[0]["reason"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_sharded_optimizer_is_refused_with_the_reason_not_shrunk_silently(netns_hosts, tmp_path):
    job, _ = run_with_fault(netns_hosts, tmp_path, "kill", flags(tmp_path),
                            train_args=("--optimizer", "sharded", "--num-replicas", "3"))
    (code,) = job.finish(240, [job.agents[0]])
    assert code == 1, job.outputs()
    (decision,) = events(job.run_dir, "decision")
    assert decision["rung"] == "give-up"
    assert "rung elastic cannot go on without them: its ShardedOptimizer shards the optimizer state over 3 ranks " \
           "(3 copies each); re-sharding it onto fewer ranks is not built" in decision["reason"], decision


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_node_that_comes_back_grows_the_job_back_bit_exact(netns_hosts, tmp_path, reference):
    """3 -> 2 -> 3 ranks: shrink on the kill, scale-out once node 1's agent is back, exit 0, bit-equal."""
    # Slower steps (they do not change the weights): the shrunk world must still be training when the
    # restarted agent (it imports torch) joins, a few steps before the end.
    job, fault_t = run_with_fault(netns_hosts, tmp_path, "kill", flags(tmp_path),
                                  train_args=(*EXACT_REDUCE, "--step-sleep-s", "2.5"))
    job.wait_for(lambda: events(job.run_dir, "decision"), 60, "the elastic decision")
    back = job.restart_agent(1)
    codes = job.finish(600)
    assert codes == [0, 0, 0], job.outputs()
    assert back.wait(1) == 0
    decisions = events(job.run_dir, "decision")
    assert [(d["rung"], d["kind"]) for d in decisions] == [("elastic", "node-lost")], decisions
    assert not events(job.run_dir, "scale_out_refused"), events(job.run_dir, "scale_out_refused")
    (grow,) = events(job.run_dir, "scale_out")
    assert (grow["from_world"], grow["to_world"], grow["agents"]) == (2, 3, [1]), grow
    (scaled,) = events(job.run_dir, "scaled_out")
    assert scaled["attempt"] == 2 and scaled["to_world"] == 3 and scaled["recover_s"] > 0, scaled
    attempts = events(job.run_dir, "attempt_started")
    assert [a["attempt"] for a in attempts] == [0, 1, 2], attempts
    started = [(e["rank"], e["attempt"]) for e in events(job.run_dir, "rank_started")]
    worlds = [len({r for r, a in started if a == attempt}) for attempt in (0, 1, 2)]
    assert worlds == [3, 2, 3], started  # world sizes 3 -> 2 -> 3
    order = [e["event"] for e in events(job.run_dir) if e["event"] in ("decision", "scale_out", "scaled_out")]
    assert order == ["decision", "scale_out", "scaled_out"], order
    (fetched,) = [e for e in events(job.run_dir, "peer_copy_fetched") if "from_rank" in e]
    assert fetched["rank"] == 1 and fetched["step"] >= 5, fetched
    restored = {e["rank"]: e for e in events(job.run_dir, "restored") if e["attempt"] == 2}
    assert sorted(restored) == [0, 1, 2], restored
    # Rank 1 restores the copy fetched from its peer (tier peer_memory); once in ~20 slow runs it said tier
    # memory instead (the fixture's "node" shares this host's /dev/shm, so node 1's files outlive its kill; the
    # cause was not pinned down). Either way the restored step is every rank's, and the weights are compared below.
    assert restored[1]["tier"] in ("peer_memory", "memory") and restored[2]["from_rank"] == 1, restored
    assert len({e["step"] for e in restored.values()}) == 1, restored
    diff = max_rel_diff(job.out, reference)
    print(f"elastic scale-out: shrunk at step {events(job.run_dir, 'restored')[0]['step']}, grown back at "
          f"step {restored[0]['step']} (decided at committed step {grow['step']}) in {scaled['recover_s']} s "
          f"(node lost to back at world 2: {events(job.run_dir, 'recovered')[0]['recover_s']} s); final weights "
          "max relative difference "
          f"{diff:.3g} against the fault-free run")
    assert diff == 0.0
