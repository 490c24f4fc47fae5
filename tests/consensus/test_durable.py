"""The durable state and the commit log against a real etcd: round trips, the once-only commit,
nothing secret or pickled written, and what a long or large job leaves in etcd bounded."""

from __future__ import annotations

import time

import msgpack
import pytest

from unbroken.consensus.durable import DurableState, DurableStore, StepAlreadyCommitted, job_prefix
from unbroken.consensus.election import Election
from unbroken.consensus.etcd import EtcdClient, EtcdError
from unbroken.errors import ConfigError

pytestmark = pytest.mark.timeout(60)
SECRET = "s3cret-Of-The-Job-0123456789"


def test_state_round_trip():
    state = DurableState(attempt=2, generation=5, committed_step=41, restart_budget=7,
                         replica_map={0: (0, 2), 2: (0, 2)}, rank_state_at={0: "node1", 3: "standby-a"})
    assert DurableState.decode(state.encode()) == state
    assert DurableState.decode(DurableState().encode()) == DurableState()


def test_job_prefix_needs_a_secret_and_hides_it():
    prefix = job_prefix(SECRET, "job-a")
    assert prefix.startswith(b"/unbroken/") and SECRET.encode() not in prefix
    assert job_prefix(SECRET, "job-b") != prefix
    with pytest.raises(ConfigError, match="UNBROKEN_SECRET"):
        job_prefix("", "job-a")


def test_commit_once_and_persist(etcd1):
    prefix = job_prefix(SECRET, "job-a")
    client = EtcdClient(etcd1.endpoints)
    election = Election(client, prefix, node="n0", address="127.0.0.1:1", ttl_s=2)
    term = election.campaign(timeout_s=5)
    store = DurableStore(client, prefix)
    assert store.load() is None
    store.record_term(term, "127.0.0.1:1")
    state = DurableState(attempt=1, generation=1, restart_budget=3, replica_map={0: (0, 1), 1: (0, 1)},
                         rank_state_at={0: "n0", 1: "n1"})
    store.save(term, state)
    state = store.commit(term, 0, state)
    state = store.commit(term, 1, state)
    assert store.load() == state and state.committed_step == 1
    with pytest.raises(StepAlreadyCommitted):
        store.commit(term, 1, state)  # not after the committed step
    # a stale copy of the state (committed_step 0) cannot commit step 1 again
    with pytest.raises(StepAlreadyCommitted, match="already committed"):
        stale = DurableState(**{**state.__dict__, "committed_step": 0})
        other = Election(client, prefix, node="n1", address="127.0.0.1:2", ttl_s=2)
        election.resign()
        store.commit(other.campaign(timeout_s=5), 1, stale)
    assert [(c.step, c.term) for c in store.commits()] == [(0, term.revision), (1, term.revision)]
    assert store.terms() == {term.revision: "n0"}
    # every value is msgpack (never pickle), and the secret is written nowhere
    for kv in client.get_prefix(b"/unbroken/"):
        assert SECRET.encode() not in kv.key + kv.value
        msgpack.unpackb(kv.value, raw=False, strict_map_key=False)
    other.resign()


# -- a long job, a large job: what etcd holds stays bounded (2026-12-06) ------------------------------
def _large_job(world_size: int):
    from unbroken.controller.api import JobPolicy, JobState
    return JobState(JobPolicy(max_restarts=3, allowed=("recover",)), world_size=world_size,
                    nnodes=world_size // 8, committed_step=7)


def test_the_state_of_a_large_fully_replicated_job_is_linear_in_its_ranks():
    """Every rank of a fully replicated job holds what every other holds: the map is one holder set,
    written once, and an index per rank (it was N tuples of N: 2.8 MB at 1,024 ranks, over etcd's 2 MB
    request limit, and 49 MB at 4,096)."""
    from unbroken.controller.durable_mirror import durable_from_job
    durable = durable_from_job(_large_job(4096))
    raw = durable.encode()
    assert len(raw) < 64 * 1024, f"{len(raw)} bytes for 4,096 ranks"
    back = DurableState.decode(raw)
    assert back == durable and back.replica_map[4095] == tuple(range(4096))
    assert back.rank_state_at[4095] == "agent511"


def test_a_state_written_by_the_earlier_form_still_loads():
    old = msgpack.packb({"attempt": 1, "generation": 2, "committed_step": 5, "restart_budget": 3,
                         "replica_map": {0: [0, 1], 1: [0, 1]}, "rank_state_at": {0: "agent0", 1: "agent1"},
                         "num_replicas": 0, "mesh": [], "mesh_replicate": "", "finished": False})
    state = DurableState.decode(old)
    assert state.replica_map == {0: (0, 1), 1: (0, 1)} and state.rank_state_at == {0: "agent0", 1: "agent1"}
    with pytest.raises(EtcdError, match="does not decode"):
        DurableState.decode(msgpack.packb({"attempt": 1, "generation": 2, "committed_step": 5, "restart_budget": 3,
                                           "replica_groups": [[0, 1]], "replica_group_of": {0: 3}}))


def _leader(etcd, prefix):
    client = EtcdClient(etcd.endpoints)
    return client, Election(client, prefix, node="n0", address="127.0.0.1:1", ttl_s=5).campaign(timeout_s=5)


def test_a_steady_commit_writes_the_step_not_the_state(etcd1):
    prefix = job_prefix(SECRET, "job-steady")
    client, term = _leader(etcd1, prefix)
    store = DurableStore(client, prefix)
    state = DurableState(attempt=1, generation=1, committed_step=3, restart_budget=2,
                         replica_map={0: (0, 1), 1: (0, 1)}, rank_state_at={0: "agent0", 1: "agent1"})
    store.save(term, state)
    written = client.get(store.state_key).mod_revision
    for step in range(4, 9):
        store.save(term, None, committed_step=step)
    assert client.get(store.state_key).mod_revision == written, "a steady commit rewrote the whole state"
    assert store.load() == DurableState(**{**state.__dict__, "committed_step": 8})
    assert len(client.get(store.step_key).value) < 16


def test_the_commit_log_keeps_the_newest_entries_of_each_term_and_attempt(etcd1, monkeypatch):
    from unbroken.consensus import durable as durable_module
    from unbroken.consensus.step_log import CommitEntry
    monkeypatch.setattr(durable_module, "STEP_LOG_KEEP", 4)
    prefix = job_prefix(SECRET, "job-long")
    client, term = _leader(etcd1, prefix)
    store = DurableStore(client, prefix)

    def entry(attempt, step):
        return CommitEntry(term=term.revision, attempt=attempt, gen=0, step=step, node="n0", t=float(step))

    store.save(term, None, [entry(0, s) for s in range(3)])  # an earlier attempt's: kept as they are
    for step in range(10):
        store.save(term, None, [entry(1, step)])
    store.save(term, None, [entry(1, s) for s in range(10, 13)])  # several at once
    assert [(e.attempt, e.step) for e in store.step_log()] == [(0, 0), (0, 1), (0, 2)] + [(1, s) for s in range(9, 13)]


def test_the_mirror_writes_the_state_only_when_more_than_the_step_moved(etcd1, monkeypatch):
    """At each commit the controller offers its state; computing the durable state is O(ranks) (and
    was O(ranks^2)), so the mirror does it, and writes it, only when its layout changed."""
    from dataclasses import replace as with_fields
    from unbroken.agent import failover
    from unbroken.agent.failover import DurableMirror
    prefix = job_prefix(SECRET, "job-mirror")
    client, term = _leader(etcd1, prefix)
    store = DurableStore(client, prefix)
    computed = []
    real = failover.durable_from_job
    monkeypatch.setattr(failover, "durable_from_job", lambda state: computed.append(state) or real(state))
    mirror = DurableMirror(store, term, on_fenced=lambda t: None)
    job = _large_job(16)
    try:
        for step in range(8, 20):
            mirror.offer(with_fields(job, committed_step=step))
            time.sleep(0.01)
        mirror.offer(with_fields(job, committed_step=20, attempt=1))  # a restart: the layout moved
    finally:
        mirror.close()
    loaded = store.load()
    assert (loaded.committed_step, loaded.attempt) == (20, 1)
    assert len(computed) == 2, f"the durable state was computed {len(computed)} times for 2 layouts"


def test_the_mirror_waits_before_it_tries_a_refused_write_again():
    from unbroken.agent.failover import DurableMirror

    class Refusing:
        def __init__(self):
            self.tries = 0

        def save(self, *args, **kwargs):
            self.tries += 1
            raise EtcdError("etcdserver: request is too large")

    store = Refusing()
    mirror = DurableMirror(store, term=None, on_fenced=lambda t: None, retry_s=0.2)
    mirror.offer(_large_job(16))
    time.sleep(1.0)
    mirror.close()
    assert 2 <= store.tries <= 7, f"{store.tries} tries in 1 s with 0.2 s between them"
