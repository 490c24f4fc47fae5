"""The nodes' summaries through a tree of agents (setting node_summaries; agent/held_reports.py makes them).

One summary per node per second is still one message per node for the controller: at 2,048 nodes its
unpacking alone takes several milliseconds a round (docs/scale.md). So the nodes form groups of
:data:`FANOUT`: the hosting agents in id order, cut into runs of FANOUT; the first of each run leads it.
A member sends its summary to its leader's relay (an authenticated connection, role ``summary``); the
leader sends the controller one :class:`~unbroken.protocol.messages.GroupSummary` a second, its own and its
members' newest summaries as columns, each member's age grown by how long the leader held it. The
controller's cost per second is then one message per group.

**Losing the leader** costs nothing but the tree: a member whose send to its leader fails sends its
summaries to the controller itself, and tries its leader again after :data:`RETRY_S`. A frozen leader
(sends still buffered) stops its group's summaries: the controller then asks every agent for the reports it
holds before it blames a rank on silence (controller/server.py), so a frozen leader never gets a healthy
rank killed. The address book (``PeerAgents``: the agents, their hosts and relay ports, the hosting ones)
comes from the controller at every start of ranks; until it does, or without one, summaries go straight
to the controller.

Threads: the relay's (``offer``, ``take_member``, ``group_due``, under the relay's lock) and one sender
(``_send_loop``: the member's sends to its leader, so that a slow link never holds up the relay).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from unbroken.errors import ConnectionClosed, ProtocolError
from unbroken.protocol import messages as m
from unbroken.protocol.wire import Connection, connect

log = logging.getLogger(__name__)

ROLE = "summary"
#: Nodes per group: the controller gets one message per this many nodes a second.
FANOUT = 64
#: After a failed send to its leader, a member sends to the controller this long before it tries again.
RETRY_S = 5.0
CONNECT_TIMEOUT_S = 2.0


def leader_of(agent: int, hosting: Sequence[int], fanout: int = FANOUT) -> int:
    """The leader of ``agent``'s group: the hosting agents in id order, in runs of ``fanout``, the first of
    each run; an agent that hosts no rank leads itself."""
    order = sorted(hosting)
    if agent not in order:
        return agent
    i = order.index(agent)
    return order[i - i % fanout]


def merge(own: tuple[float, m.NodeSummary] | None, members: dict[int, tuple[float, m.NodeSummary]], me: int,
          now: float) -> m.GroupSummary:
    """The group's summaries as columns: each agent's newest (taken in at a time), aged to ``now``."""
    rows = dict(members)
    if own is not None:
        rows[me] = own
    agents = sorted(rows)
    got = [rows[a] for a in agents]
    return m.GroupSummary(
        agents=agents, attempts=[s.attempt for _, s in got], nranks=[s.nranks for _, s in got],
        done=[s.done for _, s in got], age_s=[round(s.age_s + max(0.0, now - t), 6) for t, s in got],
        step_s=max(s.step_s for _, s in got), ckpt_s=max(s.ckpt_s for _, s in got),
        compute_s=[s.compute_s for _, s in got], slow_rank=[s.slow_rank for _, s in got],
        slow_s=[s.slow_s for _, s in got])


class SummaryTree:
    """This node's place in the tree of summaries (see the module docstring). ``send_direct`` sends a
    message on the agent's controller connection."""

    def __init__(self, secret: bytes, send_direct: Callable[[m.Message], bool], summary_s: float) -> None:
        self._secret, self._send_direct, self._summary_s = secret, send_direct, summary_s
        self._me: int | None = None
        self._leader: tuple[int, tuple[str, int]] | None = None  # (agent, address): this node is its member
        self._leading = False
        self._own: tuple[float, m.NodeSummary] | None = None
        self._members: dict[int, tuple[float, m.NodeSummary]] = {}
        self._new = False  # a summary came since the last group summary
        self._group_t = float("-inf")
        self._cv = threading.Condition()
        self._pending: m.NodeSummary | None = None  # the newest summary for the leader, not sent yet
        self._conn: Connection | None = None
        self._direct_until = 0.0  # after a failed send: straight to the controller until then
        self._stopped = False
        self._thread = threading.Thread(target=self._send_loop, name="unbroken-summary-tree", daemon=True)
        self._thread.start()
        self.to_leader = 0  # summaries sent to the leader (tests)

    def set_book(self, me: int, addresses: dict[int, tuple[str, int]], hosting: Sequence[int]) -> None:
        """The agents' relay addresses (port 0: none) and the hosting agents, from the controller."""
        leader, order = leader_of(me, hosting), sorted(hosting)
        group = set(order[order.index(leader):][:FANOUT]) if leader in order else {me}
        with self._cv:
            self._me, self._leading = me, leader == me and me in hosting
            addr = addresses.get(leader)
            self._leader = (leader, addr) if leader != me and addr is not None and addr[1] else None
            self._members = {a: got for a, got in self._members.items() if self._leading and a in group}
            self._drop_conn_locked()

    # -- the relay's calls (under its lock) ---------------------------------------------------
    def offer(self, summary: m.NodeSummary, now: float) -> None:
        """This node's summary: kept for the group (a leader), queued for the leader (a member), or sent
        to the controller (no group, or the leader unreachable)."""
        with self._cv:
            if self._leading:
                self._own, self._new = (now, summary), True
                return
            if self._leader is None or now < self._direct_until:
                direct = True
            else:
                direct = False
                self._pending = summary
                self._cv.notify_all()
        if direct:
            self._send_direct(summary)

    def take_member(self, agent: int, summary: m.NodeSummary, now: float) -> None:
        with self._cv:
            if self._leading:
                self._members[agent] = (now, summary)
                self._new = True

    def group_due(self, now: float) -> m.GroupSummary | None:
        """The group's summary, a leader's, when one is due: something new, ``summary_s`` since the last."""
        with self._cv:
            if not self._leading or not self._new or now - self._group_t < self._summary_s:
                return None
            if self._own is None and not self._members:
                return None
            self._new, self._group_t = False, now
            return merge(self._own, self._members, self._me if self._me is not None else -1, now)

    def close(self) -> None:
        with self._cv:
            self._stopped = True
            self._drop_conn_locked()
            self._cv.notify_all()
        self._thread.join(timeout=CONNECT_TIMEOUT_S + 1)

    # -- the member's sender ------------------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stopped or self._pending is not None)
                if self._stopped:
                    return
                summary, self._pending = self._pending, None
                leader, conn = self._leader, self._conn
            if leader is None:
                self._send_direct(summary)
                continue
            try:
                if conn is None:
                    conn = connect(*leader[1], self._secret, ROLE, {"agent": self._me}, timeout_s=CONNECT_TIMEOUT_S)
                    with self._cv:
                        self._conn = conn
                conn.send(summary)
                self.to_leader += 1
            except (OSError, ConnectionClosed, ProtocolError) as exc:
                log.info("agent %s: its summary leader %d is unreachable (%s): summaries go to the controller for "
                         "%g s", self._me, leader[0], exc, RETRY_S)
                with self._cv:
                    self._drop_conn_locked()
                    self._direct_until = time.monotonic() + RETRY_S
                self._send_direct(summary)

    def _drop_conn_locked(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
