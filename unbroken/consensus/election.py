"""Leader election for one job's controller, on etcd: a lease plus a key created only if absent.

Every candidate (any agent may run a controller) calls :meth:`Election.campaign`: it grants
itself a lease of ``ttl_s`` seconds and, in one transaction, creates ``<job>/leader`` bound to
that lease if and only if the key does not exist. The winner's **term** is the key's
create_revision: every later write of the leader is a transaction that first compares the
leader key's create_revision with its term (:meth:`Term.guard`), so a leader whose lease
expired (its key is gone, or another candidate's key with a newer revision is there) has every
write refused by etcd itself. That is the fence; the clock below only makes it act sooner.

Threads: the caller's, plus one keepalive thread per held term (``unbroken-etcd-lease``) that
refreshes the lease every ``ttl_s / 3`` s. A term ends (:attr:`Term.lost` is set, ``on_lost`` is
called once, from that thread) when etcd says the lease is gone or when no refresh has
succeeded within the TTL measured from when the last successful refresh was *sent*: past that
moment etcd may already have let the lease go, so the leader stops acting at once, before
another can be elected (:meth:`Term.check`). A process that was frozen (SIGSTOP) and wakes up
finds its term expired by the same clock, and its next write refused by the guard.

States of a :class:`Term`: held -> lost (lease expired or revoked, or :meth:`Election.resign`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import msgpack

from unbroken.consensus.etcd import Compare, EtcdClient, EtcdError, Put
from unbroken.errors import ConfigError, UnbrokenError

__all__ = ["Election", "Fenced", "LeaderInfo", "Term", "leader_key", "read_leader", "wait_for_leader"]


class Fenced(UnbrokenError):
    """This controller is no longer the leader (its lease expired or another leads): it must stop."""


@dataclass(frozen=True)
class LeaderInfo:
    """What the leader key says: where the leading controller listens, and its term."""
    address: str  # host:port of its control-plane server
    node: str  # who it is (agent name), for the event log and the tests
    term: int  # the leader key's create_revision


def leader_key(prefix: bytes) -> bytes:
    return prefix + b"leader"


@dataclass(eq=False)
class Term:
    """One held leadership (see the module docstring)."""
    revision: int  # the term: create_revision of the leader key
    lease: int
    key: bytes
    ttl_s: float
    node: str
    valid_until: float  # monotonic: past it, etcd may have dropped the lease
    lost: threading.Event = field(default_factory=threading.Event)

    def guard(self) -> Compare:
        """The condition every write of this leader carries: the leader key is still ours."""
        return Compare(self.key, "CREATE", self.revision)

    def check(self) -> None:
        """Raise :class:`Fenced` when this term can no longer be trusted (call before acting)."""
        if self.lost.is_set() or time.monotonic() >= self.valid_until:
            self.lost.set()
            raise Fenced(f"controller {self.node!r}: leadership term {self.revision} has ended "
                         f"(lease {self.lease:x} not refreshed within {self.ttl_s} s)")


def _encode_leader(address: str, node: str) -> bytes:
    return msgpack.packb({"address": address, "node": node})


def read_leader(client: EtcdClient, prefix: bytes) -> LeaderInfo | None:
    """The current leader of the job under ``prefix``, or None while there is none."""
    kv = client.get(leader_key(prefix))
    if kv is None:
        return None
    data = msgpack.unpackb(kv.value, raw=False, strict_map_key=True)
    if not isinstance(data, dict) or not isinstance(data.get("address"), str):
        raise EtcdError(f"etcd key {kv.key!r} does not hold a leader record (not written by unbroken?)")
    return LeaderInfo(address=data["address"], node=str(data.get("node", "")), term=kv.create_revision)


def wait_for_leader(client: EtcdClient, prefix: bytes, *, timeout_s: float, newer_than: int = 0,
                    poll_s: float = 0.05) -> LeaderInfo:
    """Poll until a leader with a term above ``newer_than`` is there (how agents and workers find
    a new controller after the old one is gone)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            leader = read_leader(client, prefix)
        except EtcdError:  # a member down or no quorum for a moment: keep asking
            leader = None
        if leader is not None and leader.term > newer_than:
            return leader
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no controller leads the job in etcd (key {leader_key(prefix)!r}) "
                               f"after {timeout_s} s")
        time.sleep(poll_s)


class Election:
    """One candidate's campaign for the job under ``prefix`` (see the module docstring)."""

    def __init__(self, client: EtcdClient, prefix: bytes, *, node: str, address: str, ttl_s: int = 2,
                 on_lost: Callable[[Term], None] | None = None) -> None:
        if ttl_s < 1:
            raise ConfigError(f"the controller lease TTL is whole seconds >= 1, got {ttl_s}")
        self.client, self.prefix, self.node, self.address = client, prefix, node, address
        self.ttl_s = ttl_s
        self.on_lost = on_lost
        self.term: Term | None = None
        self._stop = threading.Event()

    def try_lead(self) -> Term | None:
        """One attempt: the new term if this candidate now leads, else None (someone else does)."""
        key = leader_key(self.prefix)
        sent = time.monotonic()
        lease = self.client.grant(self.ttl_s)
        result = self.client.txn([Compare(key, "CREATE", 0)],
                                 [Put(key, _encode_leader(self.address, self.node), lease)])
        if not result.succeeded:
            self.client.revoke(lease)
            return None
        term = Term(revision=result.revision, lease=lease, key=key, ttl_s=self.ttl_s, node=self.node,
                    valid_until=sent + self.ttl_s)
        self.term = term
        threading.Thread(target=self._keepalive, args=(term,), name="unbroken-etcd-lease", daemon=True).start()
        return term

    def campaign(self, timeout_s: float | None = None, poll_s: float = 0.05) -> Term:
        """Block until this candidate leads (or ``timeout_s`` passes: TimeoutError)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._stop.is_set():
            try:
                term = self.try_lead()
            except EtcdError:  # no quorum for a moment: keep campaigning
                term = None
            if term is not None:
                return term
            if deadline is not None and time.monotonic() >= deadline:
                break
            time.sleep(poll_s)
        raise TimeoutError(f"controller {self.node!r} did not become leader within {timeout_s} s")

    def resign(self) -> None:
        """Give up the term now (revoking the lease deletes the leader key) and stop campaigning."""
        self._stop.set()
        term, self.term = self.term, None
        if term is not None:
            term.lost.set()
            try:
                self.client.revoke(term.lease)
            except EtcdError:
                pass  # unreachable etcd: the lease expires by itself within ttl_s

    def _keepalive(self, term: Term) -> None:
        interval = term.ttl_s / 3
        while not term.lost.is_set():
            sent = time.monotonic()
            try:
                ttl = self.client.keepalive(term.lease)
            except EtcdError:
                ttl = None  # unknown: the clock decides
            if ttl == 0:  # etcd says the lease is gone
                term.valid_until = 0.0
            elif ttl is not None:
                term.valid_until = max(term.valid_until, sent + min(ttl, term.ttl_s))
            if time.monotonic() >= term.valid_until:
                term.lost.set()
                break
            term.lost.wait(max(0.0, min(interval, term.valid_until - time.monotonic())))
        if self.on_lost is not None and not self._stop.is_set():
            self.on_lost(term)
