"""Controller seats and the leader watch against a real etcd, and the JobState <-> durable mirror."""

from __future__ import annotations

import threading
import time

import pytest

from unbroken.consensus.durable import DurableStore
from unbroken.consensus.etcd import EtcdClient
from unbroken.controller.durable_mirror import durable_from_job, job_from_durable, replica_map_of
from unbroken.consensus.seat import ControllerSeat, LeaderWatch
from unbroken.controller.api import JobPolicy, JobState

pytestmark = pytest.mark.timeout(60)
PREFIX = b"/unbroken/seat-test/"


def fresh(world_size=4, nnodes=2, **durable_fields):
    """A controller's starting state for a job of this shape (policy and shape only), with ``durable_fields``."""
    policy = JobPolicy(max_restarts=5, allowed=("recover",), replicas_allowed=True)
    return JobState(policy, world_size=world_size, nnodes=nnodes, can_dump=False, **durable_fields)


def test_mirror_round_trip():
    job = fresh(attempt=2, restarts_used=3, gen=4, committed_step=17, num_replicas=2, placement=(0, 0, 2, 1))
    durable = durable_from_job(job)
    assert (durable.attempt, durable.generation, durable.committed_step, durable.restart_budget) == (2, 4, 17, 2)
    assert durable.rank_state_at == {0: "agent0", 1: "agent0", 2: "agent2", 3: "agent1"}
    assert durable.replica_map == {0: (0, 2), 1: (1, 3), 2: (0, 2), 3: (1, 3)}
    back = job_from_durable(fresh(), durable)
    assert (back.attempt, back.restarts_used, back.gen, back.committed_step, back.placement, back.num_replicas) \
        == (2, 3, 4, 17, (0, 0, 2, 1), 2)
    assert replica_map_of(fresh()) == {r: (0, 1, 2, 3) for r in range(4)}  # full replication
    with pytest.raises(ValueError, match="world size 8"):
        job_from_durable(fresh(world_size=8, nnodes=2), durable)


def test_seats_hand_over_the_state(etcd1):
    events, led = [], threading.Event()
    changes = []

    def seat(node):
        def on_lead(term, state):
            events.append(("lead", node, term.revision, state))
            led.set()
        return ControllerSeat(EtcdClient(etcd1.endpoints, timeout_s=1.0), PREFIX, node=node,
                              address=f"127.0.0.1:{7000 + int(node[-1])}", ttl_s=1, on_lead=on_lead,
                              on_fenced=lambda term: events.append(("fenced", node, term.revision)))

    watch = LeaderWatch(EtcdClient(etcd1.endpoints), PREFIX, changes.append, poll_s=0.05)
    watch.start()
    a, b = seat("n0"), seat("n1")
    try:
        a.start()
        assert led.wait(10)
        b.start()
        _, node, term, state = events[0]
        assert (node, state) == ("n0", None)
        job = fresh(attempt=1, gen=1, committed_step=3)
        store = DurableStore(EtcdClient(etcd1.endpoints), PREFIX)
        store.save(a._election.term, durable_from_job(job))
        deadline = time.monotonic() + 5
        while not changes:  # the watch has seen n0 lead (it reports the terms it sees, not every one)
            assert time.monotonic() < deadline, events
            time.sleep(0.05)
        led.clear()
        EtcdClient(etcd1.endpoints).revoke(a._election.term.lease)  # n0's lease is gone
        assert led.wait(10)
        leads = [e for e in events if e[0] == "lead"]
        # a lease revoked behind its back: n0 hears of it at its next refresh (ttl_s / 3); its
        # writes were refused by etcd from the revocation on
        deadline = time.monotonic() + 3
        while ("fenced", "n0", term) not in events:
            assert time.monotonic() < deadline, events
            time.sleep(0.05)
        # a new term (either seat may win it: the fenced one stands again) starts from the saved state
        assert leads[1][2] > term and leads[1][3] == durable_from_job(job)
        deadline = time.monotonic() + 5
        while len(changes) < 2:
            assert time.monotonic() < deadline, (changes, events)
            time.sleep(0.05)
        assert changes[0].address == "127.0.0.1:7000" and changes[-1].term == leads[1][2]
    finally:
        a.close()
        b.close()
        watch.close()
