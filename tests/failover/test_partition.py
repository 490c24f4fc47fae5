"""The leader partitioned, with 1 of 3 etcd members lost first (issue 29), end to end: 2 nodes and a
standby agent on loopback running the example trainer, ``--controller-store`` listing the 3 members
of a real etcd.

1. Mid-run, the member that leads the etcd cluster is SIGKILLed: the job keeps training under the
   same controller (its term holds; the clients go on with the 2 members left), the committed step
   in etcd moves on.
2. Then node 0's agent, which hosts the controller, is frozen (SIGSTOP: to the rest of the job
   that is a partition of the leader; its workers run on): another seat leads with 2 of 3 members,
   the job restarts; the old leader is woken (SIGCONT) once the new one committed steps, finds its
   term over, and its node is refused.
3. The job exits 0. The commit log, read from etcd (``steps/``) and from every agent's event log
   (``step_committed``, where a fenced leader's refused entries would still show), has no step
   committed twice in one attempt, no commit by a term after a later term was won, and none after
   its controller was fenced (unbroken/consensus/step_log.py's check); the old leader's event log
   shows no other act (a decision, an order, an end) after the new term was won.

Loopback with SIGSTOP, not network namespaces: a frozen agent is cut off from etcd and from the job
alike, as a partitioned host is, and wakes with its stale view of the world."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.failover.job import SECRET, FailoverJob
from tests.integration.helpers import events
from unbroken.consensus.durable import DurableStore, job_prefix
from unbroken.consensus.election import read_leader, wait_for_leader
from unbroken.consensus.etcd import EtcdClient
from unbroken.consensus.step_log import check, entries_from_events

STEPS = 40
TRAIN = ["--step-sleep-s", "0.2", "--log-every", "1"]  # slow steps, so the faults hit the middle of the run
FLAGS = ["--recover-strategy", "recover,exit", "--node-timeout-s", "5", "--first-step-timeout-s", "300"]
# What a controller does as the leader, in its event log: a fenced one does none of it.
ACTS = ("attempt_started", "decision", "abort_generation", "restart_rank", "regroup", "stop_ranks", "step_committed",
        "job_finished")


def commit_log_problems(job: FailoverJob, store: DurableStore) -> tuple[list, list[str]]:
    """Every commit the job's controllers made (etcd's log and each agent's event log) and what is
    wrong with them."""
    entries = list(store.step_log())
    fenced_at = {}
    for agent in job.all_agents:
        records = events(job.run_dir(agent.name))
        entries += entries_from_events(records, agent.name)
        for r in records:
            if r["event"] == "controller_fenced":
                fenced_at[int(r["term"])] = min(float(r["t"]), fenced_at.get(int(r["term"]), float("inf")))
    return entries, check(entries, store.terms_won(), fenced_at)


def _leader_dir(job: FailoverJob, node: str) -> Path:
    return job.run_dir("node1" if node == "agent1" else "standby")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_etcd_member_lost_then_the_leader_partitioned_no_two_leaders_commit(etcd3, tmp_path):
    job = FailoverJob(tmp_path, etcd3.url, steps=STEPS, flags=FLAGS, train_args=TRAIN)
    client = EtcdClient(etcd3.endpoints, timeout_s=2.0)
    prefix = job_prefix(SECRET, job.job_id)
    store = DurableStore(client, prefix)
    try:
        first = wait_for_leader(client, prefix, timeout_s=60)
        assert first.node == "agent0", first
        job.wait_for(lambda: job.printed("[rank 0] step 4:"), 360, "rank 0 at step 4")
        # 1. the etcd cluster's own leader member lost: the job trains on, under the same term
        member = etcd3.leader_member()
        etcd3.kill_member(member)
        at_kill = store.load().committed_step
        job.wait_for(lambda: store.load().committed_step >= at_kill + 5, 60,
                     f"5 more steps committed in etcd after member {member} was killed")
        assert read_leader(client, prefix).term == first.term  # no failover was needed
        # 2. the leader frozen: a new one leads with 2 of 3 etcd members
        job.agents[0].popen.send_signal(signal.SIGSTOP)
        frozen_t = time.time()
        second = wait_for_leader(client, prefix, timeout_s=30, newer_than=first.term)
        assert second.node != "agent0", second
        job.wait_for(lambda: any(e.term == second.term for e in store.step_log()), 300,
                     "the new leader's first commits")
        job.agents[0].popen.send_signal(signal.SIGCONT)
        woken = job.agents[0].wait(60)  # refused by the new leader: 1 (checked below, after the log)
        # 3. the commit log: what the woken leader did in its first seconds is in it by now; and no
        # other act of it either (a decision, an order, an end) once the new term was won
        entries, problems = commit_log_problems(job, store)
        assert problems == [], problems
        won = store.terms_won()[second.term]
        late = [e for e in events(job.run_dir("node0")) if e["t"] >= won and e["event"] in ACTS]
        assert late == [], late
        assert woken == 1, job.outputs()
        assert job.finish(300, [job.agents[1], job.standby]) == [0, 0], job.outputs()
        entries, problems = commit_log_problems(job, store)  # and to the end of the job
        assert problems == [], problems
        terms = {e.term for e in entries}
        assert {first.term, second.term} <= terms, terms
        old = [e for e in entries if e.term == first.term]
        assert max(e.t for e in old) < frozen_t + 1.0  # (the freeze reached it within a second)
        (fenced,) = events(job.run_dir("node0"), "controller_fenced")
        assert fenced["term"] == first.term
        assert store.load().finished
        (takeover,) = events(_leader_dir(job, second.node), "controller_takeover")
        assert takeover["previous"] == "agent0" and takeover["lost_agents"] == [0]
        assert events(_leader_dir(job, second.node), "job_finished")[-1]["exit_code"] == 0
    finally:
        job.agents[0].popen.send_signal(signal.SIGCONT)
        job.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_leader_cut_off_from_etcd_but_not_from_its_workers_stops_committing(etcd3, tmp_path):
    """The split-brain case: node 0's agent reaches one etcd member only (its --controller-store),
    the others reach the other two. That member is killed: the leader is cut off from etcd while its
    workers and the other agents still reach it. Its term ends by its own clock before etcd can let
    its lease go, so it stops committing before another seat can lead; the others take the job over,
    and the commit log shows no commit of the old term after the new one was won."""
    m0, m1, m2 = etcd3.endpoints
    job = FailoverJob(tmp_path, f"etcd://{m1[0]}:{m1[1]},{m2[0]}:{m2[1]}", steps=STEPS, flags=FLAGS,
                      train_args=TRAIN, store_for={"node0": f"etcd://{m0[0]}:{m0[1]}"})
    client = EtcdClient([m1, m2], timeout_s=2.0)
    prefix = job_prefix(SECRET, job.job_id)
    store = DurableStore(client, prefix)
    try:
        first = wait_for_leader(client, prefix, timeout_s=60)
        assert first.node == "agent0", first
        job.wait_for(lambda: job.printed("[rank 0] step 4:"), 360, "rank 0 at step 4")
        etcd3.kill_member("m0")  # node 0's only way to etcd
        second = wait_for_leader(client, prefix, timeout_s=30, newer_than=first.term)
        assert second.node != "agent0", second
        job.wait_for(lambda: any(e.term == second.term for e in store.step_log())
                     or events(_leader_dir(job, second.node), "job_finished"), 300,
                     "the new leader's first commits (or its end)")
        time.sleep(2)  # what the old leader would still do, it does now
        entries, problems = commit_log_problems(job, store)
        assert problems == [], problems
        won = store.terms_won()[second.term]
        late = [e for e in events(job.run_dir("node0")) if e["t"] >= won and e["event"] in ACTS]
        assert late == [], late
        assert job.finish(300, [job.agents[1], job.standby]) == [0, 0], job.outputs()
        assert job.agents[0].wait(90) == 1, job.outputs()  # it finds no leader in etcd: exits 1
        entries, problems = commit_log_problems(job, store)
        assert problems == [], problems
        assert {first.term, second.term} <= {e.term for e in entries}
        (fenced,) = events(job.run_dir("node0"), "controller_fenced")
        assert fenced["term"] == first.term and fenced["t"] < won
    finally:
        job.close()
