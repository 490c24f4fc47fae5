"""Node-level faults of a non-controller node, across real network namespaces (tests/netns/hosts.py).

Two nodes of 2 ranks each (node 0 hosts the controller), a standby agent on a third host. From
outside, node 1 is killed (SIGKILL of every process), frozen (SIGSTOP of every process) or cut off
(its switch port down, then up again). With the standby, rung `recover` moves its ranks there and
the job ends with exit 0 and the fault-free run's final weights, bit for bit. A cut-off node fences
itself: its workers are gone before the controller declares it lost (controller/liveness.py), and it
does not come back when its link does. Without a standby, rung `elastic` goes on on the nodes left:
tests/netns/test_elastic.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import EXAMPLE
from tests.integration.helpers import assert_same_weights, events, reference_run
from tests.netns.job import NetnsJob

STEPS = 16
NODE_TIMEOUT_S = 5.0
# Slow steps (they do not change the weights), so that the fault hits the middle of the run.
SLOW = ["--step-sleep-s", "0.2", "--log-every", "1"]
# A first step may take minutes on a loaded 2-core machine (six workers and their spares import torch
# at once): a generous first-step timeout, so that the only fault is the one the test makes.
FLAGS = ["--recover-strategy", "recover,exit", "--node-reports", "--node-timeout-s", str(NODE_TIMEOUT_S),
         "--first-step-timeout-s", "300"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run(tmp_path_factory, steps=STEPS)


def _alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def run_with_fault(netns_hosts, tmp_path, fault: str, *, standby: bool = True, flags: list[str] = FLAGS,
                    script: Path = EXAMPLE, train_args: list[str] = SLOW):
    """Start the job, hit node 1 with ``fault`` after step 4; (job, node 1's worker pids, time.time()
    they were all gone (a frozen node's never go: the time of the fault), time.time() of the fault)."""
    hosts = netns_hosts(3)
    job = NetnsJob(hosts, tmp_path, standby=standby, steps=STEPS, train_args=train_args, flags=flags, script=script)
    job.wait_step(0, 4, timeout_s=360)
    victims = [e["pid"] for e in events(job.run_dir, "rank_started") if e["rank"] in (2, 3)]
    assert len(victims) == 2, events(job.run_dir)  # (a restart before the fault would be a fault of its own)
    fault_t = time.time()
    getattr(hosts[1], fault)()
    deadline = time.monotonic() + 60
    while fault != "freeze" and _alive(victims) and time.monotonic() < deadline:
        time.sleep(0.05)
    return job, victims, time.time(), fault_t


def _check_recovered(job: NetnsJob, reference, *, timeout_s: float = 240) -> None:
    codes = job.finish(timeout_s, [job.agents[0], job.standby])
    assert codes == [0, 0], job.outputs()
    assert_same_weights(reference, job.out)
    decisions = events(job.run_dir, "decision")
    assert [(d["rung"], d["kind"]) for d in decisions] == [("recover", "node-lost")], decisions
    (standby,) = events(job.run_dir, "standby_joined")
    moved = {e["rank"]: e["agent"] for e in events(job.run_dir, "restart_rank")}
    assert moved == {2: standby["agent"], 3: standby["agent"]}
    assert events(job.run_dir, "recovered_in_flight")[-1]["replaced"] == [2, 3]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_node_killed_its_ranks_move_to_the_standby_bit_exact(netns_hosts, tmp_path, reference):
    check_killed(*run_with_fault(netns_hosts, tmp_path, "kill"), reference)


def check_killed(job: NetnsJob, victims: list[int], _gone_t: float, _fault_t: float, reference) -> None:
    assert not _alive(victims), "a killed node's workers are gone"
    _check_recovered(job, reference)
    # A dead node closes its connections: lost at once, not after the silence timeout.
    assert not events(job.run_dir, "agent_silent")
    assert [e["node_rank"] for e in events(job.run_dir, "agent_lost")] == [1]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_node_frozen_is_lost_by_silence_and_cannot_come_back(netns_hosts, tmp_path, reference):
    check_frozen(*run_with_fault(netns_hosts, tmp_path, "freeze"), reference)


def check_frozen(job: NetnsJob, victims: list[int], _gone_t: float, fault_t: float, reference) -> None:
    assert _alive(victims), "a frozen node's workers are stopped, not dead"
    job.wait_for(lambda: events(job.run_dir, "recovered_in_flight"), 180, "the recovery onto the standby")
    job.hosts[1].thaw()  # it wakes up after the job moved on without it: its agent and workers leave
    _check_recovered(job, reference)
    (silent,) = events(job.run_dir, "agent_silent")
    assert silent["node_rank"] == 1 and silent["silent_s"] >= NODE_TIMEOUT_S
    assert silent["t"] - fault_t < NODE_TIMEOUT_S + 10  # detected within the timeout (plus load)
    assert job.agents[1].wait(90) not in (0, None), job.outputs()
    assert not _alive(victims)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_node_cut_off_fences_itself_before_it_is_declared_lost(netns_hosts, tmp_path, reference):
    job, victims, gone_t, fault_t = run_with_fault(netns_hosts, tmp_path, "cut")
    assert not _alive(victims), "the cut-off node's workers must stop on their own"
    job.wait_for(lambda: events(job.run_dir, "agent_silent"), 60, "the controller to declare node 1 silent")
    (silent,) = events(job.run_dir, "agent_silent")
    # Fencing: its workers were gone within the node timeout of the cut, and before the controller
    # declared the node lost and handed its ranks to the standby.
    assert gone_t - fault_t < NODE_TIMEOUT_S, (gone_t - fault_t)
    assert gone_t < silent["t"], (gone_t, silent["t"])
    assert job.agents[1].wait(30) == 1
    assert "fenced: no message from the controller" in job.agents[1].output()
    job.hosts[1].restore()  # the link comes back: nothing of node 1 is left to rejoin
    _check_recovered(job, reference)
    assert not job.hosts[1].pids()
