"""Per-node aggregation of the step reports: the agent's relay of its ranks' reports.

Without it every rank sends its step reports (a compute report, StepSynced, the rare in-step
marks and RankPaused) to the controller: ~2 messages per rank per step at one controller.
With it (setting ``node_reports``), each rank sends them to its node's agent over a local
authenticated connection (role ``relay``, the job secret) and the agent forwards one
:class:`~unbroken.protocol.messages.NodeReports` per batch: ~2 messages per *node* per step.
Nothing comes back this way: a step commits by the ranks' own vote (recovery/consistency.py).

What the controller must still know, and why the batching keeps it:

* **The commit record** (DESIGN.md section 4): the controller records a step committed once every
  rank's StepSynced is in, and keeps each rank's state after compute from it (a roll forward
  replaces a lost rank with it). A batch of StepSynced is sent as soon as every rank connected
  here has one in it.
* **Order**: one rank's relayed messages reach the controller in the order it sent them (one
  connection per rank, one ordered buffer per node), and the buffer is flushed before the
  agent reports a worker's exit (:meth:`NodeRelay.rank_gone`): a dead rank's last reports
  (its step-start state, its StepSynced) arrive before its death. RankPaused and any other
  report travel at once.
* **Hang blame** (controller/hangs.py): an incomplete batch is sent after ``delay_s`` (0.5 s,
  like the in-step marks), so the controller knows every rank's phase within about a second,
  well inside any hang timeout (>= 5 s unless fixed lower).
* **A dead agent** takes its workers with it (PR_SET_PDEATHSIG); its unsent batch is lost with
  them; a step they had all voted on but not reported then cannot be rolled forward in flight
  (the controller refuses it: recovery/consistency.py). A worker whose relay
  connection breaks treats it as a lost controller (worker/control.py).

**Node summaries** (setting ``node_summaries``): the steady compute reports stay here
(:class:`~unbroken.agent.held_reports.HeldReports`) and one summary a second goes instead; what is held
goes on, each entry with its age (``NodeReports.ages``), before anything that is not held, when a rank
stalls, before a worker's exit and when asked (a process seen stopped, ``FlushReports``).

Owned by one :class:`~unbroken.agent.agent.Agent`. Threads: the relay's server runs one thread
per local worker connection (``_serve``: appends, and flushes a complete batch); the agent's
watcher thread calls :meth:`flush_due` and :meth:`rank_gone`. One lock guards the buffer and is
held while a batch is sent, so batches leave in order.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from unbroken.agent.held_reports import HeldReports, Report
from unbroken.agent.summary_tree import ROLE as SUMMARY_ROLE, SummaryTree
from unbroken.errors import ConnectionClosed, ProtocolError
from unbroken.names import Phase
from unbroken.protocol import messages as m
from unbroken.protocol.framing import MAX_FRAME_BYTES
from unbroken.protocol.wire import Connection, Server

log = logging.getLogger(__name__)

#: How long an incomplete batch waits for the node's other ranks before it is sent anyway.
RELAY_DELAY_S = 0.5
#: The most state bytes one NodeReports carries (the rest of its frame is small); more: several.
BATCH_STATE_BYTES = MAX_FRAME_BYTES * 3 // 4
ENTRY_OVERHEAD_BYTES = 512  # an entry's fields besides its state, generously
#: How long rank_gone waits for a dead worker's relay connection to reach its end (its last reports).
GONE_WAIT_S = 0.5


def _batch_key(msg: m.Message) -> tuple[str, int] | None:
    """The reports every rank sends once per step, which a batch collects: compute, StepSynced."""
    if isinstance(msg, m.StepSynced):
        return ("synced", msg.step)
    if isinstance(msg, m.Progress) and msg.phase == Phase.COMPUTE:
        return ("compute", msg.step)
    return None  # anything else (RankPaused, a mark, a lone completed step, finished; SyncState: a peer may update
    # the step as soon as the rank's reduction is in, and a lost node takes a waiting batch along) goes at once


class NodeRelay:
    """One node's relay of step reports (see the module docstring). ``send`` sends one message
    on the agent's controller connection (thread-safe); False when it could not."""

    def __init__(self, secret: bytes, send: Callable[[m.Message], bool], *, host: str = "127.0.0.1",
                 delay_s: float = RELAY_DELAY_S, summaries: bool = False) -> None:
        self._send, self._delay_s = send, delay_s
        self._lock = threading.Condition()
        self._conns: dict[int, Connection] = {}  # rank -> its worker's relay connection (the newest)
        self._buffer: list[Report] = []
        # Setting node_summaries: the steady reports held here, a summary sent instead (agent/held_reports.py).
        self.held = HeldReports() if summaries else None
        self.tree = SummaryTree(secret, send, self.held.summary_s) if self.held is not None else None
        self._oldest_t: float | None = None
        self.batches_sent = 0  # NodeReports sent (for tests and benchmarks)
        self._server = Server(host, 0, secret, self._serve)

    @property
    def address(self) -> str:
        return f"{self._server.host}:{self._server.port}"

    @property
    def port(self) -> int:
        return self._server.port

    def start(self) -> None:
        self._server.start()

    def close(self) -> None:
        self.flush()
        self._server.close()
        if self.tree is not None:
            self.tree.close()

    # -- from the workers (server threads) ------------------------------------------------
    def _serve(self, conn: Connection) -> None:
        if conn.role == SUMMARY_ROLE and self.tree is not None:
            return self._serve_member(conn)
        rank, pid = conn.ident.get("rank"), conn.ident.get("pid")
        if conn.role != "relay" or type(rank) is not int or type(pid) is not int or rank < 0:
            raise ProtocolError(f"relay connection from {conn.peer} must be role 'relay' with int rank and pid, "
                                f"got role {conn.role!r}, ident {conn.ident!r}")
        with self._lock:
            self._conns[rank] = conn
        try:
            while True:
                msg = conn.recv()
                if msg.TYPE not in m.RELAYED_TYPES or getattr(msg, "rank", None) != rank:
                    log.warning("relay: rank %d sent %s (relayed: %s of its own rank only); dropped", rank,
                                msg.TYPE, ", ".join(m.RELAYED_TYPES))
                    continue
                self._add(Report(rank, pid, msg, time.monotonic(), _batch_key(msg)))
        except ConnectionClosed:
            pass
        finally:
            with self._lock:
                if self._conns.get(rank) is conn:
                    del self._conns[rank]
                self._lock.notify_all()
                if self._complete_locked():  # the batch may have waited for this rank only
                    self._flush_locked()

    def _serve_member(self, conn: Connection) -> None:
        """Another node's agent sends its summaries here: this node leads its group (agent/summary_tree.py)."""
        agent = conn.ident.get("agent")
        if type(agent) is not int or agent < 0:
            raise ProtocolError(f"summary connection from {conn.peer} must name its agent (int), got {conn.ident!r}")
        try:
            while True:
                msg = conn.recv()
                if type(msg) is not m.NodeSummary:
                    log.warning("relay: agent %d sent %s on its summary connection (NodeSummary only); dropped",
                                agent, msg.TYPE)
                    continue
                with self._lock:
                    self.tree.take_member(agent, msg, time.monotonic())
        except ConnectionClosed:
            pass

    def _add(self, entry: Report) -> None:
        with self._lock:
            if self.held is not None:
                if self.held.take(entry):
                    return
                self._buffer += self.held.release(self.held.must_release(entry))  # a rank's reports stay in order
            self._buffer.append(entry)
            if self._oldest_t is None:
                self._oldest_t = time.monotonic()
            if entry.batch is None or self._complete_locked(entry.batch):
                self._flush_locked()

    def _complete_locked(self, key: tuple[str, int] | None = None) -> bool:
        """Every connected rank has a report of ``key`` in the buffer (any key that is there: None)."""
        keys = {key} if key is not None else {e.batch for e in self._buffer if e.batch is not None}
        for k in keys:
            if set(self._conns) <= {e.rank for e in self._buffer if e.batch == k}:
                return True
        return False

    # -- from the agent's threads ------------------------------------------------------------
    def flush_due(self, now: float | None = None) -> None:
        """Send a batch that waited ``delay_s`` for the node's other ranks (the watcher thread)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if self.held is not None and self.held.stalled(now):  # a rank silent: the controller needs them all
                self._buffer += self.held.release()
                self._flush_locked()
            if self._oldest_t is not None and now - self._oldest_t >= self._delay_s:
                self._flush_locked()
            if self.held is not None:
                summary = self.held.summary(now)
                if summary is not None:
                    self.tree.offer(summary, now)  # to its group's leader, or to the controller
                group = self.tree.group_due(now)
                if group is not None:
                    self._send(group)

    def flush(self) -> None:
        """Send every report here now, held ones included (a process seen stopped, the controller asked)."""
        with self._lock:
            if self.held is not None:
                self._buffer += self.held.release()
            self._flush_locked()

    def rank_gone(self, rank: int, wait_s: float = GONE_WAIT_S) -> None:
        """``rank``'s process exited: take in what it sent before (its connection's end), then
        send the buffer, before the agent reports the exit on the same connection."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            while rank in self._conns and time.monotonic() < deadline:
                self._lock.wait(0.01)
            if self.held is not None:  # a fault: every rank's place and the dead one's own state
                self._buffer += self.held.release()
                self.held.forget(rank)
            self._flush_locked()

    # -- sending -------------------------------------------------------------------------------
    def _flush_locked(self) -> None:
        entries, self._buffer, self._oldest_t = self._buffer, [], None
        now = time.monotonic()
        while entries:
            chunk, size = [], 0
            while entries and (not chunk or size + _size(entries[0]) <= BATCH_STATE_BYTES):
                size += _size(entries[0])
                chunk.append(entries.pop(0))
            self.batches_sent += 1
            ages = [round(now - e.t, 6) for e in chunk] if self.held is not None else []
            self._send(m.NodeReports(entries=[m.encode(e.msg) for e in chunk], pids=[e.pid for e in chunk], ages=ages))


def _size(entry: Report) -> int:
    return len(getattr(entry.msg, "state", b"")) + ENTRY_OVERHEAD_BYTES
