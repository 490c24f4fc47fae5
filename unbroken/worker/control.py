"""The worker's link to the controller: registration, heartbeats, progress, fault claims.

Owned by one worker session. A reader thread receives the controller's answers and
commands; a heartbeat thread proves the *process* is alive (the controller judges the
*training loop* by step progress, never by heartbeats). Sends are thread-safe. With a relay
(setting ``node_reports``: agent/relay.py) the step reports go to the node's agent instead; a
second reader thread watches that connection's end. No commit comes from the controller: a step
commits by the ranks' vote (recovery/consistency.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from unbroken.errors import ConnectionClosed, ProtocolError
from unbroken.protocol import messages as m
from unbroken.protocol.wire import Connection, connect
from unbroken.worker.progress import StepReports

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5
MARK_POLL_S = 0.1  # the heartbeat thread's tick: it also sends in-step marks that stood long enough
LOST_CONTROLLER_GEN = 1 << 30


def _split_hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def _connect_relay(address: str, secret: str, rank: int, pid: int, attempt: int, timeout_s: float) -> Connection | None:
    """The authenticated connection to this node's agent relay; None (report directly) if it cannot be had."""
    host, port = _split_hostport(address)
    try:
        return connect(host, port, secret.encode(), "relay", {"rank": rank, "pid": pid, "attempt": attempt},
                       timeout_s=timeout_s)
    except (ConnectionClosed, ProtocolError, OSError) as exc:
        log.warning("rank %d: no relay at %s (%s); its step reports go to the controller directly", rank, address, exc)
        return None


class ControlClient:
    """One authenticated connection from a worker (rank) to its job's controller."""

    def __init__(self, address: str, secret: str, *, rank: int, pid: int, attempt: int,
                 gen: int = 0, replacement: bool = False, timeout_s: float = 10.0, relay: str = "") -> None:
        host, port = _split_hostport(address)
        self.rank = rank
        self.attempt = attempt
        # First the relay: the controller sends this rank's commits to its agent once it registered so.
        self._relay = _connect_relay(relay, secret, rank, pid, attempt, timeout_s) if relay else None
        self._conn: Connection = connect(host, port, secret.encode(), "worker",
                                         {"rank": rank, "pid": pid, "attempt": attempt},
                                         timeout_s=timeout_s)
        self._replies: queue.Queue = queue.Queue()
        self._closed = threading.Event()
        # In-flight recovery: the newest abort order and commit, set by the reader thread.
        # A rank of generation g must leave it as soon as abort_gen > g.
        self.abort_gen = gen
        self.abort_reason = ""
        # Called from the reader thread with (abort_gen, reason) on each abort order (and when the
        # controller is lost): the session fires its surviving groups' abort signal there.
        self.on_abort: Callable[[int, str], None] | None = None
        self.committed_step = -1  # the newest step the controller recorded committed, as its abort order said
        self._restore_at: dict[int, int] = {}  # restore round -> decided step, set by the reader thread
        self._restore_cv = threading.Condition()
        # progress, StepSynced, RankPaused: to the controller, or through the agent's relay
        self.reports = StepReports(self._send if self._relay is None else self._send_relay, rank=rank, attempt=attempt)
        self._conn.send(m.RankRegister(rank=rank, pid=pid, attempt=attempt, gen=gen, replacement=replacement,
                                         relay=self._relay is not None))
        self._reader = threading.Thread(target=self._read_loop, name=f"unbroken-ctl-r{rank}", daemon=True)
        self._beater = threading.Thread(target=self._beat_loop, name=f"unbroken-hb-r{rank}", daemon=True)
        self._reader.start()
        self._beater.start()
        if self._relay is not None:
            threading.Thread(target=self._read_relay, name=f"unbroken-relay-r{rank}", daemon=True).start()

    def _read_loop(self) -> None:
        while not self._closed.is_set():
            try:
                msg = self._conn.recv()
            except (ConnectionClosed, ProtocolError, OSError):
                break
            if isinstance(msg, m.Abort):  # the committed step first: a rank in a commit vote reads it after the abort
                self.committed_step = max(self.committed_step, msg.committed_step)
                self.abort_gen, self.abort_reason = max(self.abort_gen, msg.gen), msg.reason
                self._tell_abort()
            elif isinstance(msg, m.RestoreAt):
                if msg.attempt == self.attempt:
                    with self._restore_cv:
                        self._restore_at[msg.round] = msg.step
                        self._restore_cv.notify_all()
            else:
                self._replies.put(msg)
        self._lost("the controller connection was lost")

    def _read_relay(self) -> None:
        """The relay's reader thread: it watches for the agent's end (nothing is sent this way)."""
        assert self._relay is not None
        while not self._closed.is_set():
            try:
                self._relay.recv()
            except (ConnectionClosed, ProtocolError, OSError):
                break
        if not self._closed.is_set():  # the agent is gone: its relay loses this rank's reports
            self._lost("the connection to this node's agent (its relay of step reports) was lost")

    def _lost(self, reason: str) -> None:
        self._closed.set()
        self.abort_gen = LOST_CONTROLLER_GEN  # without the controller no recovery can be ordered: leave any wait
        self.abort_reason = self.abort_reason or reason
        self._tell_abort()

    def _tell_abort(self) -> None:
        listener = self.on_abort
        if listener is not None:
            listener(self.abort_gen, self.abort_reason)

    def _beat_loop(self) -> None:
        next_beat_t = time.monotonic() + HEARTBEAT_INTERVAL_S
        while not self._closed.wait(MARK_POLL_S):
            now = time.monotonic()
            self.reports.flush_due(now)
            if now >= next_beat_t:
                next_beat_t = now + HEARTBEAT_INTERVAL_S
                self._send(m.Heartbeat(rank=self.rank))

    def _send(self, msg) -> bool:
        if self._closed.is_set():
            return False
        try:
            self._conn.send(msg)
            return True
        except (OSError, ProtocolError):
            self._closed.set()
            return False

    def _send_relay(self, msg) -> bool:
        assert self._relay is not None
        if self._closed.is_set():
            return False
        try:
            self._relay.send(msg)
            return True
        except (OSError, ProtocolError):
            return False  # the relay's reader sees the end and acts on it

    def progress(self, step: int, phase: str, state: bytes = b"", state_same: bool = False, moved: bool = False) -> None:
        """The rank entered ``phase`` of ``step``: reported as :class:`StepReports` says (in-step marks late)."""
        self.reports.phase(step, phase, state=state, state_same=state_same, moved=moved)

    def step_done(self, step: int, metrics: dict, synced: bool = False) -> None:
        """The rank completed ``step`` steps (``synced``: it committed the last one without its commit
        report, Progress.synced); the report rides on the next step's compute report."""
        self.reports.done(step, metrics, synced=synced)

    def event(self, name: str, fields: dict) -> None:
        """Ask the controller to record an event of this worker's in the job's event log."""
        self._send(m.RankEvent(rank=self.rank, attempt=self.attempt, name=name, fields=fields))

    def session_ready(self, num_replicas: int, not_in_flight: str = "",
                      mesh: tuple[tuple[str, int], ...] = (), mesh_replicate: str = "", not_exact: str = "") -> None:
        self._send(m.SessionReady(rank=self.rank, attempt=self.attempt, num_replicas=num_replicas,
                                  not_in_flight=not_in_flight, mesh_names=[n for n, _ in mesh],
                                  mesh_sizes=[s for _, s in mesh], mesh_replicate=mesh_replicate,
                                  not_exact=not_exact))

    def synced(self, gen: int, step: int, state: bytes = b"", state_same: bool = False) -> None:
        """Report the reduction of ``step`` done, with this rank's own state after its compute (or
        ``state_same``: the one it last sent), before the step's commit vote (recovery/consistency.py)."""
        self.reports.send_now(m.StepSynced(rank=self.rank, attempt=self.attempt, gen=gen, step=step, state=state,
                                           state_same=state_same))

    def sync_state(self, gen: int, step: int, state: bytes = b"", state_same: bool = False) -> None:
        """This rank's own state as its reduction of ``step`` begins (a vote-less step, no file of it on the
        node: messages.SyncState); an in-step mark pending stays."""
        self.reports.send_beside(m.SyncState(rank=self.rank, attempt=self.attempt, gen=gen, step=step, state=state,
                                             state_same=state_same))

    def dumped(self, step: int, ranks: list[int], error: str) -> None:
        self._send(m.Dumped(rank=self.rank, attempt=self.attempt, step=step, ranks=ranks, error=error))

    def degraded(self, reason: str) -> None:
        self._send(m.RankDegraded(rank=self.rank, attempt=self.attempt, reason=reason))

    def damaged(self, what: str, kind: str = "memory-fault") -> None:
        self._send(m.RankDamaged(rank=self.rank, attempt=self.attempt, what=what, kind=kind))

    def paused(self, gen: int, step: int, phase: str, *, cut_in_tail: bool = False, cut_in_reduction: bool = False,
               cut_unsure: str = "") -> None:
        self.reports.send_now(m.RankPaused(rank=self.rank, attempt=self.attempt, gen=gen, step=step, phase=phase,
                                           cut_in_tail=cut_in_tail, cut_in_reduction=cut_in_reduction,
                                           cut_unsure=cut_unsure))

    def joined(self, gen: int) -> None:
        self._send(m.RankRegister(rank=self.rank, pid=0, attempt=self.attempt, gen=gen, replacement=True,
                                    relay=self._relay is not None))

    def resumed(self, gen: int, step: int, restore_s: float, phases: dict[str, Any] | None = None) -> None:
        self._send(m.RankResumed(rank=self.rank, attempt=self.attempt, gen=gen, step=step, restore_s=restore_s,
                             phases=phases or {}))

    def wait_regroup(self, timeout_s: float, on_abort, reported_gen: int) -> m.Regroup | m.Dump | None:
        """Wait for the regroup order. ``on_abort(gen)`` runs when an abort newer than
        ``reported_gen`` (the one this rank last reported for) arrives meanwhile."""
        deadline = time.monotonic() + timeout_s
        seen_gen = reported_gen
        while time.monotonic() < deadline and not self._closed.is_set():
            if self.abort_gen != seen_gen:
                seen_gen = self.abort_gen
                on_abort(seen_gen)
            try:
                msg = self._replies.get(timeout=0.05)
            except queue.Empty:
                continue
            if isinstance(msg, (m.Regroup, m.Dump)) and msg.gen >= seen_gen:
                return msg
        return None

    def claim_fault(self, fault_id: str, timeout_s: float = 10.0) -> bool:
        """Ask the controller whether an injected fault may fire (each fires once per job)."""
        if not self._send(m.ClaimFault(rank=self.rank, fault_id=fault_id)):
            return False
        while True:
            try:
                msg = self._replies.get(timeout=timeout_s)
            except queue.Empty:
                log.warning("rank %d: controller did not answer the claim of fault %s", self.rank, fault_id)
                return False
            if isinstance(msg, m.FaultClaim) and msg.fault_id == fault_id:
                return msg.granted

    def close(self) -> None:
        self.reports.flush()
        self._closed.set()
        self._conn.close()
        if self._relay is not None:
            self._relay.close()

    def restore_at(self, round_: int, memory_steps: list[int], storage_steps: list[int], timeout_s: float,
                   poll_s: float = 0.05, peer_steps: list[int] = ()) -> int | None:
        """Offer the steps this rank can load for restore round ``round_``; wait for the step the
        controller decides (-1: start fresh). None when no decision came within ``timeout_s``
        or the controller is gone."""
        if not self._send(m.RestoreOffer(rank=self.rank, attempt=self.attempt, round=round_,
                                         memory_steps=memory_steps, storage_steps=storage_steps,
                                         peer_steps=list(peer_steps))):
            return None
        deadline = time.monotonic() + timeout_s
        with self._restore_cv:
            while round_ not in self._restore_at:
                if self._closed.is_set() or time.monotonic() >= deadline:
                    return None
                self._restore_cv.wait(poll_s)
            return self._restore_at[round_]
