"""Controller failover end to end (issue 29): 2 nodes and a standby agent on loopback with
``--controller-store`` and a real etcd. Node 0's agent (which hosts the controller) and its workers
are SIGKILLed mid-run: a seat in another agent leads within 5 s, the job restarts from the memory
tier with node 0's ranks on the standby (restored from storage: their node's memory is gone), and
ends with exit 0 and the fault-free run's final weights, bit for bit."""

from __future__ import annotations

import time

import pytest

from tests.failover.job import SECRET, FailoverJob
from tests.integration.helpers import assert_same_weights, events, reference_run
from unbroken.consensus.durable import DurableStore, job_prefix
from unbroken.consensus.election import read_leader, wait_for_leader
from unbroken.consensus.etcd import EtcdClient

STEPS = 16
# Slow steps (they do not change the weights), so that the fault hits the middle of the run.
TRAIN = ["--step-sleep-s", "0.2", "--log-every", "1"]


def flags(tmp_path) -> list[str]:
    return ["--recover-strategy", "recover,exit", "--node-timeout-s", "5", "--first-step-timeout-s", "300",
            "--save", str(tmp_path / "ckpt"), "--persist-every-steps", "1"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run(tmp_path_factory, steps=STEPS, nproc=2, train_args=TRAIN)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_node0_killed_a_new_controller_leads_and_the_job_ends_bit_exact(etcd1, tmp_path, reference):
    job = FailoverJob(tmp_path, etcd1.url, steps=STEPS, flags=flags(tmp_path), train_args=TRAIN)
    client = EtcdClient(etcd1.endpoints, timeout_s=2.0)
    prefix = job_prefix(SECRET, job.job_id)
    try:
        first = wait_for_leader(client, prefix, timeout_s=60)
        assert first.node == "agent0", first  # node 0 leads first, as without the flag
        job.wait_for(lambda: job.printed("[rank 0] step 4:"), 360, "rank 0 at step 4")
        job.agents[0].kill_all()
        killed_t = time.monotonic()
        second = wait_for_leader(client, prefix, timeout_s=30, newer_than=first.term)
        failover_s = time.monotonic() - killed_t
        assert second.node != "agent0" and failover_s < 5, (second, failover_s)
        codes = job.finish(300, [job.agents[1], job.standby])
        assert codes == [0, 0], job.outputs()
        assert_same_weights(reference, job.out)
        leader_dir = job.run_dir("node1" if second.node == "agent1" else "standby")
        (takeover,) = events(leader_dir, "controller_takeover")
        assert takeover["lost_agents"] == [0] and takeover["previous"] == "agent0"
        started = events(leader_dir, "attempt_started")
        assert started and started[-1]["attempt"] == takeover["attempt"]
        (recovered,) = events(leader_dir, "recovered")
        assert recovered["restored_step"] > 0, recovered  # not a fresh start: the memory tier and storage
        store = DurableStore(client, prefix)
        state = store.load()
        assert state.finished and state.attempt == takeover["attempt"]
        assert state.rank_state_at[0] != "agent0"  # rank 0 lives on the standby now
        assert read_leader(client, prefix) is None or True  # (the last leader resigned or its lease runs out)
    finally:
        job.close()
