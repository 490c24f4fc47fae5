"""A lost node's snapshots restore from a peer node's memory (agent/peer_memory.py), across real network
namespaces (tests/netns/hosts.py).

Two nodes of 2 ranks each and a standby agent. Every agent sends its ranks' newest committed snapshot to
the next node's memory (node 1's to node 0). Node 1 is killed, its /dev/shm with it. The job restarts
(rung exit) with ranks 2 and 3 on the standby, which fetches their snapshots from node 0's copy: their
restore says tier ``peer_memory``, no storage step exists to fall back on, and the final weights equal
the fault-free run's bit for bit.
"""

from __future__ import annotations

import shutil

import pytest

from tests.integration.helpers import assert_same_weights, events, reference_run, train
from tests.netns.job import NetnsJob

STEPS = 16
SLOW = ["--step-sleep-s", "0.2", "--log-every", "1"]  # slow steps (the weights do not change) so the fault hits mid-run
BASE = ["--node-reports", "--node-timeout-s", "5", "--first-step-timeout-s", "300", "--rdzv-id", "peermem"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The fault-free run's weights (shared with test_node_faults.py when it ran first); made here
    with a generous first-step timeout: on a loaded machine the watchdog would call a slow start a hang."""
    shared = tmp_path_factory.getbasetemp() / "references" / f"{STEPS}.safetensors"
    if shared.exists():
        return reference_run(tmp_path_factory, steps=STEPS)
    result, out, _ = train(tmp_path_factory.mktemp("reference"), "reference", steps=STEPS, timeout_s=420,
                           flags=["--first-step-timeout-s", "300"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    shared.parent.mkdir(exist_ok=True)
    shutil.copyfile(out, shared)
    return shared


def _kill_node_1(netns_hosts, tmp_path, flags: list[str]) -> NetnsJob:
    hosts = netns_hosts(3)
    job = NetnsJob(hosts, tmp_path, standby=True, steps=STEPS, train_args=SLOW,
                   flags=[*flags, *BASE, "--save", str(tmp_path / "ckpt")])
    job.wait_step(0, 5, timeout_s=360)
    job.wait_for(lambda: any(events(job.run_dir, "attempt_started")), 10, "the first attempt")
    hosts[1].kill()
    return job


def _restored(job: NetnsJob) -> dict[int, str]:
    return {e["rank"]: e["tier"] for e in events(job.run_dir, "restored")}


def _check_restarted_from_peer_memory(job: NetnsJob, reference) -> None:
    codes = job.finish(300, [job.agents[0], job.standby])
    assert codes == [0, 0], job.outputs()
    assert_same_weights(reference, job.out)
    decisions = [(d["rung"], d["kind"]) for d in events(job.run_dir, "decision")]
    assert decisions == [("exit", "node-lost")], decisions
    fetched = {e["rank"]: e for e in events(job.run_dir, "peer_copy_fetched")}
    assert sorted(fetched) == [2, 3] and {e["agent"] for e in fetched.values()} == {0}, fetched
    assert _restored(job) == {0: "memory", 1: "memory", 2: "peer_memory", 3: "peer_memory"}, events(job.run_dir)
    (decided,) = [e for e in events(job.run_dir, "restore_decided") if e["attempt"] == 1]
    assert decided["tiers"] == ["memory", "memory", "peer_memory", "peer_memory"], decided
    assert not list((job.tmp / "ckpt").glob("step_*/MANIFEST.json"))  # nothing in storage to fall back on


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_node_killed_job_restarts_on_the_standby_from_peer_memory_bit_exact(netns_hosts, tmp_path, reference):
    job = _kill_node_1(netns_hosts, tmp_path, ["--recover-strategy", "exit", "--persist-every-steps", "0"])
    _check_restarted_from_peer_memory(job, reference)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_in_flight_refused_no_replicas_falls_to_a_restart_from_peer_memory(netns_hosts, tmp_path, reference):
    flags = ["--recover-strategy", "recover,exit", "--no-replica-restore", "--persist-every-steps", "0"]
    job = _kill_node_1(netns_hosts, tmp_path, flags)
    _check_restarted_from_peer_memory(job, reference)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_without_peer_memory_the_lost_ranks_restore_from_storage(netns_hosts, tmp_path, reference):
    flags = ["--recover-strategy", "exit", "--no-peer-memory", "--persist-every-steps", "2"]
    job = _kill_node_1(netns_hosts, tmp_path, flags)
    codes = job.finish(300, [job.agents[0], job.standby])
    assert codes == [0, 0], job.outputs()
    assert_same_weights(reference, job.out)
    assert not events(job.run_dir, "peer_copy_fetched")
    restored = _restored(job)
    assert restored[2] == restored[3] == "storage", restored
