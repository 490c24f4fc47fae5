"""Peer copies of the memory tier (checkpoint/peer_copy.py, agent/peer_memory.py): a copy commits only
once whole and verified, a truncated or corrupt one never replaces the complete one, a wrong secret is
refused, files are 0600, and the job's clean-up removes them."""

from __future__ import annotations

import os
import socket
import stat
import threading

import pytest
import torch

from unbroken.agent.peer_memory import ROLE, PeerMemory
from unbroken.checkpoint import peer_copy as pc
from unbroken.checkpoint.memory import SnapshotWriter
from unbroken.checkpoint.memory_reader import SnapshotReader
from unbroken.checkpoint.shm_files import (claim_job, peer_marker_path, peer_slot_path, remove_job, slot_path,
                                           sweep_stale)
from unbroken.errors import AuthError, CheckpointCorrupt, ConnectionClosed
from unbroken.protocol.wire import connect

SHM = "/dev/shm"
SECRET = b"peer-copy-test-secret-0123456789abcdef"


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 33, generator=g), "b": torch.randn(7, generator=g), "step": seed}


def _write(job: str, rank: int, step: int) -> dict:
    state = _state(step)
    w = SnapshotWriter(SHM, job, rank)
    w.write(step, state)
    w.flush()
    w.close()
    return state


def _stream(job: str, rank: int) -> bytes:
    """What send_slot puts on the wire for the newest committed slot of ``rank``."""
    paths = [slot_path(SHM, job, rank, s) for s in (0, 1)]
    slot, _ = pc.newest_committed(paths)
    a, b = socket.socketpair()
    out = bytearray()
    reader = threading.Thread(target=lambda: out.extend(_read_all(b)))
    reader.start()
    pc.send_slot(a, paths[slot], rank)
    a.close()
    reader.join()
    b.close()
    return bytes(out)


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def _receive(job: str, rank: int, data: bytes):
    """receive_slot of ``data`` (a stream as _stream makes it) into the peer slots of ``rank``."""
    a, b = socket.socketpair()
    sender = threading.Thread(target=lambda: (a.sendall(data), a.close()))
    sender.start()
    try:
        kind, r, step, seq, nbytes = pc.read_peer_header(b)
        assert kind == pc.Kind.SNAPSHOT and r == rank
        paths = [peer_slot_path(SHM, job, rank, s) for s in (0, 1)]
        return pc.receive_slot(b, paths, rank, step, seq, nbytes, __import__("pathlib").Path(SHM))
    finally:
        sender.join()
        b.close()


def _same(a: dict, b: dict) -> None:
    assert a["step"] == b["step"]
    for k in ("w", "b"):
        assert torch.equal(a[k], b[k])


def test_a_copy_commits_whole_and_reads_back_bit_equal(job):
    state = _write(job, 3, 5)
    h = _receive(job, 3, _stream(job, 3))
    assert h.step == 5
    got, _ = SnapshotReader(SHM, job, 3, peer=True).load()
    _same(got, state)
    for s in (0, 1):
        p = peer_slot_path(SHM, job, 3, s)
        if p.exists():
            assert stat.S_IMODE(os.stat(p).st_mode) == 0o600


@pytest.mark.parametrize("damage", ["truncated", "corrupt"])
def test_a_truncated_or_corrupt_copy_never_replaces_the_complete_one(job, damage):
    first = _write(job, 1, 10)
    _receive(job, 1, _stream(job, 1))
    _write(job, 1, 11)
    data = bytearray(_stream(job, 1))
    if damage == "truncated":
        data = data[:len(data) - 1000]
        with pytest.raises(ConnectionClosed):
            _receive(job, 1, bytes(data))
    else:
        data[pc.PEER_HEADER.size + 4096 + 100] ^= 0xFF  # a tensor byte flipped on the way
        with pytest.raises(CheckpointCorrupt):
            _receive(job, 1, bytes(data))
    reader = SnapshotReader(SHM, job, 1, peer=True)
    assert [s for s, _ in reader.committed()] == [10]
    got, _ = reader.load()
    _same(got, first)
    # and the next complete copy goes in the slot that did not hold step 10's
    _write(job, 1, 12)
    _receive(job, 1, _stream(job, 1))
    assert sorted(s for s, _ in reader.committed()) == [10, 12]


def _service(job: str, agent: int, ranks, secret: bytes = SECRET) -> PeerMemory:
    # poll_s: the sender thread never runs by itself; the test calls send_round (one sender at a time)
    p = PeerMemory(secret, SHM, job, agent, lambda: list(ranks), host="127.0.0.1", poll_s=3600)
    p.start()
    return p


def test_the_ring_successor_keeps_the_copy_and_a_replacement_fetches_it(job):
    a, b, c = _service(job, 0, [0]), _service(job, 1, [1]), _service(job, 2, [])
    try:
        book = {0: ("127.0.0.1", a.port), 1: ("127.0.0.1", b.port), 2: ("127.0.0.1", c.port)}
        for p in (a, b, c):
            p.set_peers(book, hosting={0, 1})
        state = _write(job, 1, 7)
        assert b.send_round() == 1 and b.send_round() == 0  # once per snapshot
        assert a.stats["copies_received"] == 1 and b.stats["bytes_sent"] > 64 * 33 * 4
        assert SnapshotReader(SHM, job, 1, peer=True).committed() != []
        # node 1 is lost: its own slots go with it; agent 2 (the standby) fetches rank 1's copy
        for s in (0, 1):
            slot_path(SHM, job, 1, s).unlink(missing_ok=True)
        del book[1]
        c.set_peers(book, hosting={0, 2})
        got = c.fetch_missing([1])
        assert got[1]["agent"] == 0 and got[1]["step"] == 7
        reader = SnapshotReader(SHM, job, 1)
        loaded, _ = reader.load()
        _same(loaded, state)
        assert reader.last_seq == got[1]["seq"]
        assert peer_marker_path(SHM, job, 1).exists()
        assert c.fetch_missing([1]) == {}  # a rank with its own snapshot fetches nothing
    finally:
        for p in (a, b, c):
            p.stop()
    remove_job(SHM, job)
    assert not [n for n in os.listdir(SHM) if job in n]  # nothing left behind


def test_a_rank_taken_in_by_a_scale_out_fetches_a_survivors_two_snapshots_in_place_of_its_own(job):
    """controller/elastic.py: a scale-out's rank gets a surviving rank's own snapshots, from that node."""
    a, c = _service(job, 0, [0]), _service(job, 2, [])
    try:
        book = {0: ("127.0.0.1", a.port), 2: ("127.0.0.1", c.port)}
        for p in (a, c):
            p.set_peers(book, hosting={0})
        w = SnapshotWriter(SHM, job, 0)
        for step in (5, 6):
            w.write(step, _state(step))
            w.flush()
        w.close()
        _write(job, 2, 1)  # what an older life of the node left under rank 2: never restored
        got = c.fetch_replica(2, 0, 0)
        assert got["agent"] == 0 and got["step"] == 6
        reader = SnapshotReader(SHM, job, 2)
        assert sorted(s for s, _ in reader.committed()) == [5, 6]
        _same(reader.load()[0], _state(6))
        _same(reader.load(5)[0], _state(5))
        assert peer_marker_path(SHM, job, 2).exists()
        assert c.fetch_replica(3, 0, 1) is None  # agent 0 holds no snapshot of rank 1
        assert c.fetch_replica(3, 1, 0) is None  # agent 1 is not in the book
    finally:
        for p in (a, c):
            p.stop()
    remove_job(SHM, job)
    assert not [n for n in os.listdir(SHM) if job in n]


def test_a_wrong_secret_is_refused(job):
    p = _service(job, 0, [])
    try:
        with pytest.raises(AuthError):
            connect("127.0.0.1", p.port, b"not-the-job-secret-at-all-0123456789", ROLE, {"agent": 9})
    finally:
        p.stop()


def test_a_crashed_agents_peer_copies_are_swept_by_the_next_run(job):
    _write(job, 2, 3)
    _receive(job, 2, _stream(job, 2))
    dead = __import__("subprocess").Popen(["true"])
    dead.wait()
    claim_job(SHM, job, dead.pid)  # the owner (an agent killed with its node) is gone
    assert [n for n in os.listdir(SHM) if n.startswith(f"unbroken-{job}-p")]
    assert job in sweep_stale(SHM)
    assert not [n for n in os.listdir(SHM) if job in n]


def test_a_copy_whose_slot_header_disagrees_with_its_announcement_is_refused(job):
    _write(job, 4, 8)
    _receive(job, 4, _stream(job, 4))
    _write(job, 4, 9)
    data = bytearray(_stream(job, 4))
    kind, rank, step, seq, nbytes = pc.PEER_HEADER.unpack(bytes(data[:pc.PEER_HEADER.size]))[2:7]
    data[:pc.PEER_HEADER.size] = pc.pack_header(pc.Kind.SNAPSHOT, rank, step + 100, seq, nbytes)  # lies about its step
    with pytest.raises(CheckpointCorrupt, match="not a committed snapshot matching"):
        _receive(job, 4, bytes(data))
    assert [s for s, _ in SnapshotReader(SHM, job, 4, peer=True).committed()] == [8]
