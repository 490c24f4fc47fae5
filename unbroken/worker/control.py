"""The worker's link to the controller: registration, heartbeats, progress, fault claims.

Owned by one worker session. A reader thread receives the controller's answers and
commands; a heartbeat thread proves the *process* is alive (the controller judges the
*training loop* by step progress, never by heartbeats). Sends are thread-safe.
"""

from __future__ import annotations

import logging
import queue
import threading

from unbroken.errors import ConnectionClosed, ProtocolError
from unbroken.protocol import messages as m
from unbroken.protocol.wire import Connection, connect

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5


def _split_hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


class ControlClient:
    """One authenticated connection from a worker (rank) to its job's controller."""

    def __init__(self, address: str, secret: str, *, rank: int, pid: int, attempt: int,
                 timeout_s: float = 10.0) -> None:
        host, port = _split_hostport(address)
        self.rank = rank
        self.attempt = attempt
        self._conn: Connection = connect(host, port, secret.encode(), "worker",
                                         {"rank": rank, "pid": pid, "attempt": attempt},
                                         timeout_s=timeout_s)
        self._replies: queue.Queue = queue.Queue()
        self._closed = threading.Event()
        self._conn.send(m.WorkerRegister(rank=rank, pid=pid, attempt=attempt))
        self._reader = threading.Thread(target=self._read_loop, name=f"unbroken-ctl-r{rank}", daemon=True)
        self._beater = threading.Thread(target=self._beat_loop, name=f"unbroken-hb-r{rank}", daemon=True)
        self._reader.start()
        self._beater.start()

    def _read_loop(self) -> None:
        while not self._closed.is_set():
            try:
                msg = self._conn.recv()
            except (ConnectionClosed, ProtocolError, OSError):
                break
            self._replies.put(msg)
        self._closed.set()

    def _beat_loop(self) -> None:
        while not self._closed.wait(HEARTBEAT_INTERVAL_S):
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

    def progress(self, step: int, phase: str, metrics: dict) -> None:
        self._send(m.Progress(rank=self.rank, attempt=self.attempt, step=step, phase=phase, metrics=metrics))

    def event(self, name: str, fields: dict) -> None:
        """Ask the controller to record an event of this worker's in the job's event log."""
        self._send(m.WorkerEvent(rank=self.rank, attempt=self.attempt, name=name, fields=fields))

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
        self._closed.set()
        self._conn.close()
