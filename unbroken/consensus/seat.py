"""A controller seat: what an agent runs to take the job's controller over when it may lead.

:class:`ControllerSeat` campaigns in its own thread (``unbroken-controller-seat``). When it
wins, it records the term, loads the durable state the last leader left (None for a new job),
and calls ``on_lead(term, state)``: the host starts its controller from that state. When the
term ends (lease lost, or a write refused), it calls ``on_fenced(term)`` at once, from the
keepalive thread: the host stops its controller before anything else, and the seat campaigns
again (a partitioned agent that comes back is a candidate like any other). A seat that is
:meth:`close`\\ d resigns its term. :class:`LeaderWatch` is the other side: an agent or worker
that follows the leader's address through the store, told of every new term.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from unbroken.consensus.durable import DurableState, DurableStore
from unbroken.consensus.election import Election, LeaderInfo, Term, read_leader
from unbroken.consensus.etcd import EtcdClient, EtcdError

__all__ = ["ControllerSeat", "LeaderWatch"]


class ControllerSeat:
    """One agent's candidacy for the job's controller (see the module docstring)."""

    def __init__(self, client: EtcdClient, prefix: bytes, *, node: str, address: str, ttl_s: int,
                 on_lead: Callable[[Term, DurableState | None], None],
                 on_fenced: Callable[[Term], None]) -> None:
        self.store = DurableStore(client, prefix)
        self._client, self._prefix, self._node, self._address, self._ttl_s = client, prefix, node, address, ttl_s
        self._on_lead, self._on_fenced = on_lead, on_fenced
        self._closed = threading.Event()
        self._term_over = threading.Event()
        self._election: Election | None = None
        self._thread = threading.Thread(target=self._run, name="unbroken-controller-seat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        self._closed.set()
        self._term_over.set()
        if self._election is not None:
            self._election.resign()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._closed.is_set():
            self._term_over.clear()
            self._election = Election(self._client, self._prefix, node=self._node, address=self._address,
                                      ttl_s=self._ttl_s, on_lost=self._lost)
            try:
                term = self._election.campaign(timeout_s=self._ttl_s * 2)
            except TimeoutError:
                continue  # another leads: keep standing
            try:
                self.store.record_term(term, self._address)
                state = self.store.load()
            except EtcdError:  # the term ended (Fenced) or etcd went away before we could act
                self._election.resign()
                continue
            if self._closed.is_set():
                break
            self._on_lead(term, state)
            self._term_over.wait()

    def _lost(self, term: Term) -> None:
        self._on_fenced(term)
        self._term_over.set()


class LeaderWatch:
    """Follows the job's leader in etcd: ``on_change(leader)`` for every new term, from its own
    thread (``unbroken-leader-watch``), polling every ``poll_s``."""

    def __init__(self, client: EtcdClient, prefix: bytes, on_change: Callable[[LeaderInfo], None],
                 poll_s: float = 0.1) -> None:
        self._client, self._prefix, self._on_change, self._poll_s = client, prefix, on_change, poll_s
        self.leader: LeaderInfo | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="unbroken-leader-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                leader = read_leader(self._client, self._prefix)
            except EtcdError:
                leader = None  # no quorum for a moment: keep the last known leader
            if leader is not None and (self.leader is None or leader.term > self.leader.term):
                self.leader = leader
                self._on_change(leader)
            self._stop.wait(self._poll_s)
