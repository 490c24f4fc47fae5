"""A partition of the leading controller (SIGSTOP past its lease, then SIGCONT) and a SIGKILL of
it, with candidates as real processes: the commit log in etcd shows every step committed once,
each by the term that led at that revision, and none by a fenced leader."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO
from unbroken.consensus.durable import DurableStore
from unbroken.consensus.election import wait_for_leader
from unbroken.consensus.etcd import EtcdClient

pytestmark = pytest.mark.timeout(120)
PREFIX = "/unbroken/partition-test/"


def start(cluster, node, out, steps, prefix=PREFIX, ttl_s=2):
    endpoints = ",".join(f"{h}:{p}" for h, p in cluster.endpoints)
    return subprocess.Popen([sys.executable, "-m", "tests.consensus.candidate", "--endpoints", endpoints,
                             "--prefix", prefix, "--node", node, "--out", str(out), "--steps", str(steps),
                             "--ttl-s", str(ttl_s)],
                            cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), start_new_session=True)


def records(out):
    return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def wait_commits(store, count, timeout_s):
    deadline = time.monotonic() + timeout_s
    while len(store.commits()) < count:
        assert time.monotonic() < deadline, f"fewer than {count} commits within {timeout_s} s"
        time.sleep(0.05)


def audit(store, log):
    """Every step once, each by the term leading at its revision, and no success claimed by a
    process that etcd does not show."""
    commits = store.commits()
    terms = sorted(store.terms())
    steps = [c.step for c in commits]
    assert steps == list(range(len(steps))), f"steps committed out of order or twice: {steps}"
    for c in commits:
        assert c.term in terms, f"step {c.step} committed by an unrecorded term {c.term}"
        later = [t for t in terms if t > c.term]
        assert not later or c.revision < later[0], \
            f"step {c.step} committed by term {c.term} at revision {c.revision}, after term {later[0]} began"
    in_log = {(c.step, c.term) for c in commits}
    claimed = [(r["step"], r["term"]) for r in log if r["event"] == "commit"]
    assert len(claimed) == len(set(claimed)) and set(claimed) <= in_log, (claimed, in_log)
    return commits


@pytest.mark.parametrize("members", [1, pytest.param(3, marks=pytest.mark.slow)])  # 3: also a member lost
def test_sigstop_of_the_leader_fences_it(tmp_path, members, request):
    cluster = request.getfixturevalue(f"etcd{members}")
    out = tmp_path / "candidates.jsonl"
    client = EtcdClient(cluster.endpoints, timeout_s=1.0)
    store = DurableStore(client, PREFIX.encode())
    procs = {n: start(cluster, n, out, steps=10**6) for n in ("a", "b")}
    try:
        first = wait_for_leader(client, PREFIX.encode(), timeout_s=20)
        wait_commits(store, 5, 20)
        stopped = procs[first.node]
        stopped.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        second = wait_for_leader(client, PREFIX.encode(), timeout_s=10, newer_than=first.term)
        failover_s = time.monotonic() - t0
        assert second.node != first.node and failover_s < 5, (second, failover_s)
        if members == 3:
            cluster.kill_member("m2")  # and one etcd member lost while the new leader acts
        count = len(store.commits())
        wait_commits(store, count + 5, 20)
        stopped.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 10
        while not any(r["event"] == "fenced" and r["term"] == first.term for r in records(out)):
            assert time.monotonic() < deadline, "the woken leader did not report itself fenced"
            time.sleep(0.05)
        wait_commits(store, len(store.commits()) + 5, 20)  # the job goes on after the wake-up
    finally:
        for proc in procs.values():
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait(10)
    commits = audit(store, records(out))
    by_term = {c.term for c in commits}
    assert {first.term, second.term} <= by_term


def test_sigkill_of_the_leader_hands_over_within_5_s(etcd1, tmp_path):
    out = tmp_path / "candidates.jsonl"
    client = EtcdClient(etcd1.endpoints, timeout_s=1.0)
    store = DurableStore(client, PREFIX.encode())
    procs = {n: start(etcd1, n, out, steps=40) for n in ("a", "b")}
    try:
        first = wait_for_leader(client, PREFIX.encode(), timeout_s=20)
        wait_commits(store, 5, 20)
        procs[first.node].kill()
        t0 = time.monotonic()
        second = wait_for_leader(client, PREFIX.encode(), timeout_s=10, newer_than=first.term)
        assert time.monotonic() - t0 < 5
        survivor = procs[second.node]
        assert survivor.wait(30) == 0  # it carried the job's steps to the end
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait(10)
    commits = audit(store, records(out))
    assert [c.step for c in commits] == list(range(40))
