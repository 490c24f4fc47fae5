"""The durable state and the commit log against a real etcd: round trips, the once-only commit,
and nothing secret or pickled written."""

from __future__ import annotations

import msgpack
import pytest

from unbroken.consensus.durable import DurableState, DurableStore, StepAlreadyCommitted, job_prefix
from unbroken.consensus.election import Election
from unbroken.consensus.etcd import EtcdClient
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
