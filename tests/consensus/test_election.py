"""Leader election and fencing against a real etcd (1 member; 3 members with one lost)."""

from __future__ import annotations

import time

import pytest

from unbroken.consensus.durable import DurableState, DurableStore
from unbroken.consensus.election import Election, Fenced, read_leader, wait_for_leader
from unbroken.consensus.etcd import EtcdClient

pytestmark = pytest.mark.timeout(90)
PREFIX = b"/unbroken/test-job/"


def candidate(cluster, node, ttl_s=1, **kw):
    return Election(EtcdClient(cluster.endpoints, timeout_s=1.0), PREFIX, node=node,
                    address=f"127.0.0.1:{9000 + int(node[-1])}", ttl_s=ttl_s, **kw)


def test_one_leader_then_the_next(etcd1):
    a, b = candidate(etcd1, "n0"), candidate(etcd1, "n1")
    term_a = a.try_lead()
    assert term_a is not None
    assert b.try_lead() is None  # the key exists: b does not lead
    client = EtcdClient(etcd1.endpoints)
    assert read_leader(client, PREFIX).node == "n0"
    time.sleep(2.5)  # over two TTLs: the keepalive thread holds the term
    term_a.check()
    assert read_leader(client, PREFIX).term == term_a.revision
    a.resign()
    with pytest.raises(Fenced):
        term_a.check()
    term_b = b.campaign(timeout_s=5)
    leader = wait_for_leader(client, PREFIX, timeout_s=2, newer_than=term_a.revision)
    assert (leader.node, leader.address, leader.term) == ("n1", "127.0.0.1:9001", term_b.revision)
    b.resign()


def test_lost_lease_fences_the_leader(etcd1):
    lost = []
    a = candidate(etcd1, "n0", on_lost=lost.append)
    term = a.try_lead()
    store = DurableStore(EtcdClient(etcd1.endpoints), PREFIX)
    store.save(term, DurableState(attempt=1))
    # someone revokes the lease behind the leader's back (as etcd does when it expires)
    EtcdClient(etcd1.endpoints).revoke(term.lease)
    deadline = time.monotonic() + 3
    while not lost:
        assert time.monotonic() < deadline, "the keepalive thread did not notice the lost lease"
        time.sleep(0.05)
    assert lost == [term] and term.lost.is_set()
    with pytest.raises(Fenced):
        term.check()
    # etcd refuses the write too, even when the local clock still trusted the term
    term.lost.clear()
    term.valid_until = time.monotonic() + 60
    b = candidate(etcd1, "n1")
    term_b = b.campaign(timeout_s=5)
    with pytest.raises(Fenced, match="another controller leads"):
        store.save(term, DurableState(attempt=99))
    with pytest.raises(Fenced):
        store.commit(term, 0, DurableState(attempt=99))
    assert store.load().attempt == 1
    store.commit(term_b, 0, store.load())
    assert [c.term for c in store.commits()] == [term_b.revision]
    a.resign()
    b.resign()


def test_losing_one_of_three_members_is_tolerated(etcd3):
    # A 3 s lease: the keepalive (every TTL / 3) that finds m0 gone must reach another member within
    # the TTL; with a 1 s lease a loaded machine (a refresh and a failover past 1 s) fenced a healthy leader.
    a, b = candidate(etcd3, "n0", ttl_s=3), candidate(etcd3, "n1", ttl_s=3)
    term_a = a.campaign(timeout_s=10)
    store = DurableStore(EtcdClient(etcd3.endpoints, timeout_s=1.0), PREFIX)
    state = store.commit(term_a, 0, DurableState())
    etcd3.kill_member("m0")  # the member every client tries first
    time.sleep(3.5)  # over the TTL: the term survives, its keepalive went to another member
    term_a.check()
    state = store.commit(term_a, 1, state)
    a.resign()
    term_b = b.campaign(timeout_s=10)
    store.commit(term_b, 2, state)
    assert [(c.step, c.term) for c in store.commits()] == \
        [(0, term_a.revision), (1, term_a.revision), (2, term_b.revision)]
    b.resign()


def test_losing_the_etcd_leader_member_keeps_the_term_and_the_commit_log(etcd3):
    """The member that leads etcd is SIGKILLed: a term of the default lease (2 s) holds through
    etcd's own re-election, and the mirror's guarded writes (state and commit log) go on through
    the members left (the client tries each endpoint in turn)."""
    from unbroken.agent.failover import DurableMirror

    a = candidate(etcd3, "n0", ttl_s=2)
    term = a.campaign(timeout_s=10)
    store = DurableStore(EtcdClient(etcd3.endpoints, timeout_s=1.0), PREFIX)
    fenced = []
    mirror = DurableMirror(store, term, fenced.append)
    mirror.committed({"t": 1.0, "attempt": 0, "gen": 0, "step": 0})
    etcd3.kill_member(etcd3.leader_member())
    killed = time.monotonic()
    for step in range(1, 6):
        time.sleep(0.5)
        mirror.committed({"t": 1.0 + step, "attempt": 0, "gen": 0, "step": step})
    mirror.close(timeout_s=10)
    assert time.monotonic() - killed > 2  # past the lease: it was refreshed through another member
    term.check()
    assert fenced == [] and [e.step for e in store.step_log()] == list(range(6))
    a.resign()
