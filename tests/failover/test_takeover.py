"""Controller failover on the control plane alone, fast (the default run's representative of
tests/failover/test_node0_lost.py): real `unbroken run` agents on loopback with a real etcd, and
workers that need no torch (tests/failover/scripts/wait_then_exit.py). Node 0's agent, which leads,
is SIGKILLed with its worker: another agent's seat leads within 5 s and starts its controller from
the durable state in etcd, the agents find it there, node 0's rank moves to the standby, the job
restarts (attempt 1) and ends with exit 0; the durable state says where each rank lives now."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.failover.job import SECRET, FailoverJob
from tests.integration.helpers import events
from unbroken.consensus.durable import DurableStore, job_prefix
from unbroken.consensus.election import wait_for_leader
from unbroken.consensus.etcd import EtcdClient

SCRIPT = Path(__file__).parent / "scripts" / "wait_then_exit.py"
FLAGS = ["--recover-strategy", "recover,exit", "--node-timeout-s", "5"]


def _leader_dir(job: FailoverJob, node: str) -> Path:
    return job.run_dir("node1" if node == "agent1" else "standby")


def _started(job: FailoverJob, client, prefix):
    """The job running its first attempt under node 0's controller; (leader, etcd store)."""
    first = wait_for_leader(client, prefix, timeout_s=60)
    assert first.node == "agent0", first  # node 0 leads first, as without the flag
    job.wait_for(lambda: len(events(job.run_dir("node0"), "rank_started")) == 2
                 and events(job.run_dir("node0"), "standby_joined"), 60, "both workers and the standby")
    store = DurableStore(client, prefix)
    job.wait_for(lambda: (s := store.load()) is not None and s.rank_state_at == {0: "agent0", 1: "agent1"},
                 30, "the durable state mirrored into etcd")
    return first, store


@pytest.mark.timeout(180)
def test_node0_lost_a_seat_takes_over_from_the_durable_state(etcd1, tmp_path):
    job = FailoverJob(tmp_path, etcd1.url, script=SCRIPT, flags=FLAGS)
    client = EtcdClient(etcd1.endpoints, timeout_s=2.0)
    prefix = job_prefix(SECRET, job.job_id)
    try:
        first, store = _started(job, client, prefix)
        job.agents[0].kill_all()
        killed_t = time.monotonic()
        second = wait_for_leader(client, prefix, timeout_s=30, newer_than=first.term)
        failover_s = time.monotonic() - killed_t
        assert second.node != "agent0" and failover_s < 5, (second, failover_s)
        assert job.finish(90, [job.agents[1], job.standby]) == [0, 0], job.outputs()
        run_dir = _leader_dir(job, second.node)
        (takeover,) = events(run_dir, "controller_takeover")
        assert takeover["previous"] == "agent0" and takeover["lost_agents"] == [0] and takeover["attempt"] == 1
        (standby,) = events(run_dir, "standby_joined")
        started = {e["rank"]: e for e in events(run_dir, "rank_started")}
        assert sorted(started) == [0, 1] and all(e["attempt"] == 1 for e in started.values())
        assert events(run_dir, "job_finished")[-1]["exit_code"] == 0
        state = store.load()
        assert state.finished and state.attempt == 1
        assert state.rank_state_at == {0: f"agent{standby['agent']}", 1: "agent1"}
        assert state.restart_budget == 32767 - 1  # the takeover's restart counts
        # (a seat may still win once the last leader resigned at the end: it finds the job ended, leads nothing)
        assert sorted(store.terms())[:2] == [first.term, second.term]
    finally:
        job.close()


@pytest.mark.timeout(180)
def test_a_frozen_leader_is_fenced_and_its_node_is_not_let_back(etcd1, tmp_path):
    """SIGSTOP of node 0's agent past its lease: another seat leads; on SIGCONT the old controller
    finds its term over and stops acting (it takes no part in the job any more), and its agent,
    following the new leader, is refused: its rank lives on the standby now."""
    job = FailoverJob(tmp_path, etcd1.url, script=SCRIPT, flags=FLAGS)
    client = EtcdClient(etcd1.endpoints, timeout_s=2.0)
    prefix = job_prefix(SECRET, job.job_id)
    try:
        first, store = _started(job, client, prefix)
        job.agents[0].popen.send_signal(signal.SIGSTOP)
        second = wait_for_leader(client, prefix, timeout_s=30, newer_than=first.term)
        assert second.node != "agent0"
        job.wait_for(lambda: events(_leader_dir(job, second.node), "attempt_started"), 60, "the restart")
        job.agents[0].popen.send_signal(signal.SIGCONT)
        assert job.agents[0].wait(60) == 1, job.outputs()  # refused by the new leader
        assert job.finish(90, [job.agents[1], job.standby]) == [0, 0], job.outputs()
        (fenced,) = events(job.run_dir("node0"), "controller_fenced")
        assert "leadership term" in fenced["reason"], fenced
        old = [e for e in events(job.run_dir("node0")) if e["t"] > fenced["t"]]
        assert not [e for e in old if e["event"] in ("attempt_started", "decision", "job_finished")], old
        (refused,) = events(_leader_dir(job, second.node), "agent_refused")
        assert refused["node_rank"] == 0
    finally:
        job.agents[0].popen.send_signal(signal.SIGCONT)
        job.close()
