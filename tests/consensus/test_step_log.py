"""The wired controller's commit log (unbroken/consensus/step_log.py): the check that finds two
leaders acting at once, on hand-made logs, and the guarded writes against a real etcd (a leader
whose term is over has its entries refused)."""

from __future__ import annotations

import pytest

from unbroken.agent.failover import DurableMirror
from unbroken.consensus.durable import DurableStore, job_prefix
from unbroken.consensus.election import Election
from unbroken.consensus.etcd import EtcdClient
from unbroken.consensus.step_log import CommitEntry, check, entries_from_events

pytestmark = pytest.mark.timeout(60)
SECRET = "s3cret-Of-The-Job-0123456789"


def _entry(term: int, attempt: int, step: int, t: float, node: str = "agent0") -> CommitEntry:
    return CommitEntry(term=term, attempt=attempt, gen=0, step=step, node=node, t=t)


def test_a_clean_log_with_a_takeover_that_redoes_steps_passes():
    # term 10 commits steps 0-4 of attempt 0; term 20 (won at t=105) restarts at attempt 1 and redoes 3-4
    log = [_entry(10, 0, s, 100.0 + s * 0.1) for s in range(5)] + \
          [_entry(20, 1, s, 106.0 + s * 0.1, "agent1") for s in range(3, 8)]
    assert check(log + log[:3], {10: 99.0, 20: 105.0}, {10: 104.0}) == []  # the same entry twice counts once


def test_a_commit_after_a_newer_term_was_won_is_two_leaders():
    log = [_entry(10, 0, 0, 100.0), _entry(10, 0, 1, 105.5), _entry(20, 1, 1, 106.0, "agent1")]
    (problem,) = check(log, {10: 99.0, 20: 105.0})
    assert "committed by term 10 (agent0)" in problem and "after term 20 was won: two leaders acted" in problem


def test_a_commit_after_the_fence_and_a_step_committed_twice():
    log = [_entry(10, 0, 0, 100.0), _entry(10, 0, 1, 101.0), _entry(10, 0, 1, 101.5)]
    problems = check(log, {10: 99.0}, {10: 101.2})
    assert len(problems) == 2
    assert "after its controller was fenced" in problems[0]
    assert "step 1 of attempt 0 committed 2 times" in problems[1]
    assert "which no leader recorded" in check([_entry(7, 0, 0, 1.0)], {10: 0.5})[0]


def test_entries_from_an_event_log():
    records = [{"t": 3.5, "event": "step_committed", "term": 4, "attempt": 1, "gen": 2, "step": 9},
               {"t": 3.6, "event": "controller_fenced", "reason": "x"}]
    assert entries_from_events(records, "agent1") == [CommitEntry(4, 1, 2, 9, "agent1", 3.5)]


def test_the_mirror_writes_the_log_and_etcd_refuses_a_fenced_leaders_entries(etcd1):
    prefix = job_prefix(SECRET, "job-log")
    client = EtcdClient(etcd1.endpoints)
    store = DurableStore(client, prefix)
    old = Election(client, prefix, node="agent0", address="127.0.0.1:1", ttl_s=2)
    term = old.campaign(timeout_s=5)
    store.record_term(term, "127.0.0.1:1")
    fenced = []
    mirror = DurableMirror(store, term, fenced.append)
    for step in range(3):
        mirror.committed({"t": 100.0 + step, "attempt": 0, "gen": 1, "step": step})
    mirror.close()
    assert [(e.term, e.attempt, e.step, e.gen, e.node) for e in store.step_log()] == \
        [(term.revision, 0, s, 1, "agent0") for s in range(3)]
    # another leader wins (the old lease revoked, as if it expired); the old one still "commits"
    client.revoke(term.lease)
    new = Election(client, prefix, node="agent1", address="127.0.0.1:2", ttl_s=2).campaign(timeout_s=5)
    store.record_term(new, "127.0.0.1:2")
    late = DurableMirror(store, term, fenced.append)
    late.committed({"t": 200.0, "attempt": 0, "gen": 1, "step": 3})
    late.close()
    assert fenced == [term] and late.refused_steps == 1
    assert [e.step for e in store.step_log()] == [0, 1, 2]  # etcd kept none of the fenced leader's
    won = store.terms_won()
    assert sorted(won) == [term.revision, new.revision] and won[term.revision] <= won[new.revision]
    # the fenced leader's entry, as its event log has it, is caught by the check
    (problem,) = check([*store.step_log(), _entry(term.revision, 0, 3, won[new.revision] + 0.5)], won)
    assert "two leaders acted" in problem
    old.resign()
