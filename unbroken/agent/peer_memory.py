"""Peer memory: each node's newest committed snapshots are also held in another node's memory.

A :class:`PeerMemory` lives in each agent that has a memory tier. It owns:

* a server (``wire.Server``: every connection proves the job secret first) that keeps the copies
  other nodes send (unbroken.checkpoint.peer_copy: two slots per rank, committed only once
  verified), answers "which copy of rank R do you hold" and sends a copy back;
* a sender thread (niced) that streams each committed snapshot of this node's ranks, newest
  only, to the ring successor: the next agent hosting ranks, by agent id, as the controller's
  address book (``PeerAgents``) says. Node k's copies live on node k + 1 (mod the nodes), so the
  loss of one node never takes a snapshot and its copy together. It reads the workers' slots
  without pinning them (their writer never waits for the network; a copy torn by a rewrite fails
  the receiver's checksums and the next one goes);
* :meth:`fetch_missing`, run by the agent's command thread before it starts the workers of a job
  restart: a rank with no committed snapshot here (it moved from a lost node) gets the newest
  copy any peer holds, into its own slots, with a marker that makes its restore say
  ``peer_memory``;
* :meth:`fetch_replica`, the same at a scale-out (controller/elastic.py): a rank taken in gets a
  surviving rank's own snapshots, straight from that rank's node.

Counters (``stats``) say what the copies cost: copies and bytes sent, seconds spent sending.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from unbroken.checkpoint import peer_copy as pc
from unbroken.checkpoint.shm_files import (check_dir, peer_marker_path, peer_slot_path, slot_path,
                                           write_json_marker)
from unbroken.errors import CheckpointError, ProtocolError
from unbroken.protocol.wire import Connection, Server, connect

log = logging.getLogger(__name__)

ROLE = "peer-copy"
NICE = 10  # the sender's niceness: the training processes come first
CONNECT_TIMEOUT_S = 5.0
STALL_S = 30.0  # a send or an answer that makes no progress this long fails (the peer is gone or frozen)
RETRY_S = 1.0  # after a failed send, the sender waits this long before it connects again


class PeerMemory:
    """One node's peer copies (see the module docstring); ``stop`` ends its threads."""

    def __init__(self, secret: bytes, shm_dir: str | os.PathLike, job_id: str, agent: int,
                 ranks: Callable[[], list[int]], *, host: str = "127.0.0.1", poll_s: float = 0.05) -> None:
        self._secret, self._dir, self._job, self.agent = secret, check_dir(shm_dir), job_id, agent
        self._ranks, self._poll_s = ranks, poll_s
        self._server = Server(host, 0, secret, self._serve)
        self.port = self._server.port
        self._lock = threading.Lock()
        self._peers: dict[int, tuple[str, int]] = {}  # agent id -> its peer-memory address
        self._successor: int | None = None
        self._sent_seq: dict[int, int] = {}  # rank -> seq of the newest copy the successor acknowledged
        self._stop = threading.Event()
        self._conn: Connection | None = None  # the sender thread's, to the successor
        self._moved = False  # the successor changed: the sender thread drops its connection
        self._serving = 0  # connection handlers running (stop waits for them: no file appears after it)
        self._idle = threading.Condition(self._lock)
        self._failing = False
        self.stats = {"copies_sent": 0, "bytes_sent": 0, "send_s": 0.0, "copies_refused": 0,
                      "copies_received": 0, "bytes_received": 0}
        self._thread = threading.Thread(target=self._send_loop, name="unbroken-peer-send", daemon=True)

    def start(self) -> None:
        self._server.start()
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop sending and serving; returns once no handler can still create a file (the agent
        removes the job's files next), or after ``timeout_s``."""
        self._stop.set()
        self._thread.join(timeout=timeout_s)
        self._server.close()  # closes the live connections: a handler in a receive fails at once
        self._drop_conn()
        with self._idle:
            self._idle.wait_for(lambda: self._serving == 0, timeout=timeout_s)

    def set_peers(self, peers: dict[int, tuple[str, int]], hosting: set[int], me: int | None = None) -> None:
        """The controller's address book: every agent's peer-memory address, which agents host ranks,
        and this agent's id (``me``: a standby's differs from its node rank). The successor is the
        next hosting agent after this one (ring order by agent id)."""
        if me is not None:
            self.agent = me
        ring = sorted(a for a in hosting if a in peers and peers[a][1])
        later = [a for a in ring if a > self.agent] or [a for a in ring if a < self.agent]
        successor = later[0] if self.agent in ring and later else None
        with self._lock:
            self._peers = dict(peers)
            if successor != self._successor:
                self._successor, self._moved = successor, True
        log.info("agent %d: peer memory: copies go to agent %s", self.agent, successor)

    # -- sending -------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
        except (AttributeError, OSError):
            pass
        while not self._stop.wait(self._poll_s):
            try:
                self.send_round()
            except (OSError, ProtocolError, CheckpointError) as exc:
                self._drop_conn()
                if not self._failing:
                    log.warning("agent %d: sending a peer copy to agent %s failed (retrying every %.0f s; the "
                                "memory tier and storage go on): %s", self.agent, self._successor, RETRY_S, exc)
                self._failing = True
                self._stop.wait(RETRY_S)

    def send_round(self) -> int:
        """Send the newest committed snapshot of each local rank not sent yet; the copies sent. Called by
        the sender thread (one caller at a time: it owns the connection to the successor)."""
        with self._lock:
            successor, moved, self._moved = self._successor, self._moved, False
            addr = self._peers.get(successor) if successor is not None else None
        if moved:  # a new successor holds none of our copies yet
            self._drop_conn()
            self._sent_seq = {}
        if addr is None:
            return 0
        sent = 0
        for rank in self._ranks():
            paths = [slot_path(self._dir, self._job, rank, s) for s in (0, 1)]
            newest = pc.newest_committed(paths)
            if newest is None or self._sent_seq.get(rank) == newest[1].seq:
                continue
            sock = self._connect(addr).raw_socket()
            started = time.perf_counter()
            h = pc.send_slot(sock, paths[newest[0]], rank)
            if h is None:  # rewritten since: the next round sends the newer one
                continue
            kind, _, _, seq, _ = pc.read_peer_header(sock)
            seconds = time.perf_counter() - started
            self._sent_seq[rank] = h.seq  # refused or not, this one is done (a refusal is logged there)
            self.stats["bytes_sent"] += pc.copy_bytes(h) + 2 * pc.PEER_HEADER.size
            self.stats["send_s"] += seconds
            if kind == pc.Kind.ACK and seq == h.seq:
                self.stats["copies_sent"] += 1
                sent += 1
                self._failing = False
            else:
                self.stats["copies_refused"] += 1
        return sent

    def _connect(self, addr: tuple[str, int]) -> Connection:
        if self._conn is None or self._conn.closed:
            self._conn = connect(addr[0], addr[1], self._secret, ROLE, {"agent": self.agent},
                                 timeout_s=CONNECT_TIMEOUT_S)
            self._conn.raw_socket().settimeout(STALL_S)  # a frozen successor cannot hold the sender forever
        return self._conn

    def _drop_conn(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    # -- serving (the server's connection threads) ----------------------------------------------
    def _serve(self, conn: Connection) -> None:
        with self._idle:
            if self._stop.is_set():
                return
            self._serving += 1
        try:
            self._serve_stream(conn)
        finally:
            with self._idle:
                self._serving -= 1
                self._idle.notify_all()

    def _serve_stream(self, conn: Connection) -> None:
        if conn.role != ROLE:
            raise ProtocolError(f"peer-memory port: role {conn.role!r} is not {ROLE!r}")
        sock = conn.raw_socket()
        while not self._stop.is_set():
            kind, rank, step, seq, nbytes = pc.read_peer_header(sock)  # ConnectionClosed ends the handler
            paths = [peer_slot_path(self._dir, self._job, rank, s) for s in (0, 1)]
            if kind == pc.Kind.SNAPSHOT:
                try:
                    h = pc.receive_slot(sock, paths, rank, step, seq, nbytes, self._dir)
                except CheckpointError as exc:  # (ConnectionClosed: a truncated copy, ends the handler)
                    log.warning("agent %d: refused the peer copy of rank %d step %d from %s: %s",
                                self.agent, rank, step, conn.peer, exc)
                    sock.sendall(pc.pack_header(pc.Kind.REFUSED, rank, step, seq))
                    continue
                self.stats["copies_received"] += 1
                self.stats["bytes_received"] += nbytes
                sock.sendall(pc.pack_header(pc.Kind.ACK, rank, h.step, h.seq))
            elif kind == pc.Kind.FETCH:
                newest = pc.newest_committed(paths)
                if newest is None or pc.send_slot(sock, paths[newest[0]], rank, pin=True) is None:
                    sock.sendall(pc.pack_header(pc.Kind.NONE, rank))
            elif kind == pc.Kind.FETCH_OWN:  # a scale-out: this node's own snapshots of the rank, both slots
                own = [slot_path(self._dir, self._job, rank, s) for s in (0, 1)]
                for path in pc.committed_oldest_first(own):
                    pc.send_slot(sock, path, rank, pin=True)
                sock.sendall(pc.pack_header(pc.Kind.NONE, rank))
            elif kind == pc.Kind.PROBE:
                newest = pc.newest_committed(paths)
                sock.sendall(pc.pack_header(pc.Kind.NONE, rank) if newest is None else
                             pc.pack_header(pc.Kind.ACK, rank, newest[1].step, newest[1].seq))
            else:
                raise ProtocolError(f"peer-memory port: unexpected {kind.name} from {conn.peer}")

    # -- fetching at a job restart (the agent's command thread) -----------------------------------
    def fetch_missing(self, ranks: list[int], timeout_s: float = 60.0) -> dict[int, dict]:
        """For each rank of ``ranks`` with no committed snapshot in this node's memory, fetch the
        newest copy a peer holds into its own slots; {rank: {agent, step, seq, bytes, seconds}} of
        the copies fetched. A peer that fails is skipped (the rank then restores from storage)."""
        with self._lock:
            peers = {a: addr for a, addr in self._peers.items() if a != self.agent and addr[1]}
        got: dict[int, dict] = {}
        for rank in ranks:
            own = [slot_path(self._dir, self._job, rank, s) for s in (0, 1)]
            if pc.newest_committed(own) is not None or not peers:
                continue
            offers = {}
            for agent, addr in sorted(peers.items()):
                try:
                    with self._peer_conn(addr, timeout_s) as conn:
                        sock = conn.raw_socket()
                        sock.sendall(pc.pack_header(pc.Kind.PROBE, rank))
                        kind, _, step, seq, _ = pc.read_peer_header(sock)
                    if kind == pc.Kind.ACK:
                        offers[agent] = (seq, step)
                except (OSError, ProtocolError) as exc:
                    log.warning("agent %d: asking agent %d for its copy of rank %d failed: %s", self.agent, agent,
                                rank, exc)
            for agent in sorted(offers, key=lambda a: offers[a], reverse=True):  # the newest copy first
                done = self._fetch(rank, agent, peers[agent], own, timeout_s)
                if done is not None:
                    got[rank] = done
                    break
        return got

    def fetch_replica(self, rank: int, agent: int, source: int, timeout_s: float = 60.0) -> dict | None:
        """A scale-out took this node in: ``rank`` gets the committed snapshots (both slots, the newest
        last) that agent ``agent``'s own rank ``source`` wrote, into ``rank``'s own slots here, whatever
        was there removed first; {agent, step, seq, bytes, seconds} of the newest, None if none came."""
        with self._lock:
            addr = self._peers.get(agent)
        if addr is None or not addr[1]:
            log.warning("agent %d: agent %d keeps no peer memory: no snapshot of rank %d to fetch", self.agent,
                        agent, source)
            return None
        own = [slot_path(self._dir, self._job, rank, s) for s in (0, 1)]
        for path in (*own, peer_marker_path(self._dir, self._job, rank)):  # an older life's: never restored
            path.unlink(missing_ok=True)
        started, newest, nbytes = time.perf_counter(), None, 0
        try:
            with self._peer_conn(addr, timeout_s) as conn:
                sock = conn.raw_socket()
                sock.settimeout(timeout_s)
                sock.sendall(pc.pack_header(pc.Kind.FETCH_OWN, source))
                while True:
                    kind, _, step, seq, size = pc.read_peer_header(sock)
                    if kind != pc.Kind.SNAPSHOT:
                        break
                    newest = pc.receive_slot(sock, own, source, step, seq, size, self._dir)
                    nbytes += size
        except (OSError, ProtocolError, CheckpointError) as exc:  # what was committed before it stays
            log.warning("agent %d: fetching rank %d's snapshots from agent %d failed: %s", self.agent, source,
                        agent, exc)
        if newest is None:
            return None
        write_json_marker(peer_marker_path(self._dir, self._job, rank),
                          {"seq": newest.seq, "step": newest.step, "agent": agent})
        return {"agent": agent, "step": newest.step, "seq": newest.seq, "bytes": nbytes,
                "seconds": round(time.perf_counter() - started, 4)}

    def _fetch(self, rank: int, agent: int, addr: tuple[str, int], own: list[Path], timeout_s: float
               ) -> dict | None:
        started = time.perf_counter()
        try:
            with self._peer_conn(addr, timeout_s) as conn:
                sock = conn.raw_socket()
                sock.settimeout(timeout_s)
                sock.sendall(pc.pack_header(pc.Kind.FETCH, rank))
                kind, _, step, seq, nbytes = pc.read_peer_header(sock)
                if kind != pc.Kind.SNAPSHOT:
                    return None
                h = pc.receive_slot(sock, own, rank, step, seq, nbytes, self._dir)
        except (OSError, ProtocolError, CheckpointError) as exc:
            log.warning("agent %d: fetching the copy of rank %d from agent %d failed: %s", self.agent, rank,
                        agent, exc)
            return None
        write_json_marker(peer_marker_path(self._dir, self._job, rank),
                          {"seq": h.seq, "step": h.step, "agent": agent})
        return {"agent": agent, "step": h.step, "seq": h.seq, "bytes": nbytes,
                "seconds": round(time.perf_counter() - started, 4)}

    def _peer_conn(self, addr: tuple[str, int], timeout_s: float) -> Connection:
        return connect(addr[0], addr[1], self._secret, ROLE, {"agent": self.agent},
                       timeout_s=min(timeout_s, CONNECT_TIMEOUT_S))
