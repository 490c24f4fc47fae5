"""Peer copies of the memory tier: a committed snapshot slot sent to another node, and kept there.

A rank's committed slot (unbroken.checkpoint.memory) is copied byte for byte, header, tensors,
meta and checksum table, to another node's agent, which keeps it in its own shared-memory
directory under the peer names of shm_files (``unbroken-{job}-p{rank:05d}-s{0,1}``, mode 0600),
two slots per rank like the memory tier: a copy is received into the slot that does not hold
the newest complete one, verified against its own checksum table, and only then committed, so
a half-received or corrupt copy never replaces the previous complete one. A copy fetched back
at a restore lands in the rank's own slots the same way.

The stream, on the raw socket of a connection that passed the job secret's handshake
(unbroken.protocol.handshake): a typed header (:data:`PEER_HEADER`: magic, version, kind, rank,
step, seq, byte count, crc32) and then, for a snapshot, that many raw bytes of the slot file.
Nothing received is ever unpickled; the bytes are read with the memory tier's own verified
reader. Used by the agent's peer-memory service (unbroken.agent.peer_memory), in its threads.
"""

from __future__ import annotations

import enum
import fcntl
import json
import mmap
import os
import socket
import struct
import zlib
from pathlib import Path

import xxhash

from unbroken.checkpoint.capacity import HEADER_BYTES, headroom_bytes
from unbroken.checkpoint.memory import HASH, HEADER, META_FORMAT, VERSION, SlotHeader, SlotState, hashed_ranges, \
    read_header
from unbroken.checkpoint.shm_files import open_ours, open_slot
from unbroken.errors import CheckpointCorrupt, CheckpointError, ConnectionClosed, ProtocolError

PEER_MAGIC, PEER_VERSION = b"UBPEERMC", 2  # 2: FETCH_OWN
# magic, version, kind, rank, step, seq, nbytes, crc32 of everything before it
PEER_HEADER = struct.Struct("<8sIIqqqQI")
#: The largest copy a node accepts (a slot is one rank's state: far below this).
MAX_COPY_BYTES = 1 << 40
_STATE = struct.Struct("<I")
_STATE_OFFSET = 12  # where SlotHeader's state lives (unbroken.checkpoint.memory)
_RECV_BYTES = 4 << 20


class Kind(enum.IntEnum):
    SNAPSHOT = 1  # a slot's bytes follow
    FETCH = 2  # "send me your newest copy of rank R"
    NONE = 3  # "I hold none"
    ACK = 4  # a snapshot was received: seq of what is now committed (-1: refused), step
    REFUSED = 5  # a snapshot was not kept (corrupt, torn by a rewrite, no room)
    PROBE = 6  # "which copy of rank R do you hold": answered by ACK (step, seq) or NONE
    FETCH_OWN = 7  # "send me rank R's own committed snapshots" (a scale-out): SNAPSHOTs, oldest first, then NONE


def pack_header(kind: Kind, rank: int = 0, step: int = -1, seq: int = 0, nbytes: int = 0) -> bytes:
    body = PEER_HEADER.pack(PEER_MAGIC, PEER_VERSION, kind, rank, step, seq, nbytes, 0)[:-4]
    return body + struct.pack("<I", zlib.crc32(body))


def read_peer_header(sock: socket.socket) -> tuple[Kind, int, int, int, int]:
    """(kind, rank, step, seq, nbytes) of the next header; ProtocolError if it is not ours."""
    raw = recv_exact(sock, PEER_HEADER.size)
    magic, version, kind, rank, step, seq, nbytes, crc = PEER_HEADER.unpack(raw)
    if magic != PEER_MAGIC or zlib.crc32(raw[:-4]) != crc:
        raise ProtocolError("peer-memory stream: not a peer-copy header (bad magic or crc32)")
    if version != PEER_VERSION:
        raise ProtocolError(f"peer-memory stream: version {version}, this node speaks {PEER_VERSION}; "
                            "run the same unbroken version on every node")
    if kind not in Kind._value2member_map_ or rank < 0 or nbytes > MAX_COPY_BYTES:
        raise ProtocolError(f"peer-memory stream: bad header (kind {kind}, rank {rank}, {nbytes} bytes)")
    return Kind(kind), rank, step, seq, nbytes


def recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    buf = bytearray(nbytes)
    recv_into(sock, memoryview(buf))
    return bytes(buf)


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; ConnectionClosed if the stream ends first (a truncated copy)."""
    got, total = 0, len(view)
    while got < total:
        try:
            n = sock.recv_into(view[got:], min(total - got, _RECV_BYTES))
        except OSError as exc:
            raise ConnectionClosed(f"peer-memory stream failed after {got} of {total} bytes: {exc}") from None
        if n == 0:
            raise ConnectionClosed(f"peer-memory stream ended after {got} of {total} bytes")
        got += n


def drain(sock: socket.socket, nbytes: int) -> None:
    """Read and drop ``nbytes`` (a copy that is refused: the stream stays in step)."""
    scratch = memoryview(bytearray(min(nbytes, _RECV_BYTES) or 1))
    while nbytes > 0:
        n = min(nbytes, len(scratch))
        recv_into(sock, scratch[:n])
        nbytes -= n


def copy_bytes(h: SlotHeader) -> int:
    """The bytes of a slot a copy carries: up to the end of its checksum table."""
    return h.table_off + HASH.size * h.n_chunks


# ---- the sending side -------------------------------------------------------------------------


def newest_committed(paths: list[Path]) -> tuple[int, SlotHeader] | None:
    """(slot, header) of the newest committed slot of ``paths`` (by seq), or None."""
    found = [(h.seq, slot, h) for slot, p in enumerate(paths)
             if (h := read_header(p)) is not None and h.state == SlotState.COMMITTED]
    if not found:
        return None
    _, slot, h = max(found, key=lambda item: item[:2])
    return slot, h


def committed_oldest_first(paths: list[Path]) -> list[Path]:
    """The committed slots of ``paths``, the oldest (by seq) first."""
    found = [(h.seq, p) for p in paths if (h := read_header(p)) is not None and h.state == SlotState.COMMITTED]
    return [p for _, p in sorted(found)]


def send_slot(sock: socket.socket, path: Path, rank: int, *, pin: bool = False) -> SlotHeader | None:
    """Stream the committed slot at ``path`` (header first, then its bytes, with sendfile: no copy
    through this process). Returns its header, or None when it is not committed (nothing sent).

    ``pin``: hold LOCK_SH while sending (a peer copy served back at a restore). Without it (a
    worker's live slot: its writer must never wait for the network), the slot may be rewritten
    meanwhile; the receiver's checksums then refuse the copy, and the sender learns it from the
    header it reads again afterwards.
    """
    fd = open_ours(path)
    if fd is None:
        return None
    try:
        if pin:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return None
        h = SlotHeader.unpack(os.pread(fd, HEADER.size, 0))
        if h is None or h.state != SlotState.COMMITTED or os.fstat(fd).st_size < copy_bytes(h):
            return None
        nbytes = copy_bytes(h)
        sock.sendall(pack_header(Kind.SNAPSHOT, rank, h.step, h.seq, nbytes))
        # socket.sendfile: os.sendfile, waiting for the socket's timeout where it has one
        with os.fdopen(fd, "rb", buffering=0, closefd=False) as f:
            sent = sock.sendfile(f, 0, nbytes)
        if sent != nbytes:
            raise ConnectionClosed(f"peer-memory stream: {path} shrank while it was sent ({sent} of {nbytes} bytes)")
        return h
    finally:
        os.close(fd)


# ---- the receiving side -----------------------------------------------------------------------


def receive_slot(sock: socket.socket, paths: list[Path], rank: int, step: int, seq: int, nbytes: int,
                 shm_dir: Path) -> SlotHeader:
    """Receive a copy announced by a SNAPSHOT header into one of ``paths`` (the two slots of a
    rank): the one not holding the newest committed copy. It is committed only once every byte
    arrived and matches its checksum table; CheckpointCorrupt (checksums, a header that disagrees
    with the announcement), CheckpointError (no room: the rest of the stream is drained) or
    ConnectionClosed (truncated) leave that slot uncommitted and the other one untouched."""
    if nbytes < HEADER_BYTES:
        drain(sock, nbytes)
        raise CheckpointCorrupt(f"peer copy of rank {rank} step {step}: {nbytes} bytes, less than a slot header")
    head = recv_exact(sock, HEADER_BYTES)
    h = SlotHeader.unpack(head)
    if h is None or h.state != SlotState.COMMITTED or (h.step, h.seq) != (step, seq) or copy_bytes(h) != nbytes \
            or not HEADER_BYTES <= h.data_off <= h.meta_off <= h.table_off or h.chunk_bytes <= 0:
        drain(sock, nbytes - HEADER_BYTES)
        raise CheckpointCorrupt(f"peer copy of rank {rank} step {step}: its slot header is not a committed "
                                "snapshot matching the announcement")
    newest = newest_committed(paths)
    slot = 0 if newest is None else 1 - newest[0]
    fd = open_slot(paths[slot])
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a reader pins the older copy: keep both, drop this one
            drain(sock, nbytes - HEADER_BYTES)
            raise CheckpointError(f"peer copy of rank {rank} step {step}: {paths[slot]} is being read") from None
        _take(fd, paths[slot], nbytes, shm_dir, sock)
        mm = mmap.mmap(fd, nbytes)
        try:
            with memoryview(mm) as view:
                recv_into(sock, view[HEADER_BYTES:nbytes])
                verify(view, h, paths[slot])
            mm[:HEADER.size] = h._replace(state=SlotState.COPIED).pack()
            _STATE.pack_into(mm, _STATE_OFFSET, SlotState.COMMITTED)  # the commit point
        finally:
            try:
                mm.close()
            except BufferError:  # a view of it is held by the traceback of a failed copy: the GC unmaps it
                pass
        return h
    finally:
        os.close(fd)  # drops the flock


def _take(fd: int, path: Path, nbytes: int, shm_dir: Path, sock: socket.socket) -> None:
    """Make the slot at ``fd`` an uncommitted file of ``nbytes``, its space allocated (a full
    shm dir fails here with a clear error, never with SIGBUS in the copy)."""
    if os.fstat(fd).st_size >= HEADER.size:
        os.pwrite(fd, _STATE.pack(SlotState.WRITING), _STATE_OFFSET)  # unlisted before anything else
    size = os.fstat(fd).st_size
    if size < nbytes:
        st = os.statvfs(shm_dir)
        free = st.f_bavail * st.f_frsize
        if nbytes - size + headroom_bytes(free) > free:
            drain(sock, nbytes - HEADER_BYTES)
            raise CheckpointError(f"no room for a peer copy of {nbytes} bytes in {shm_dir} ({free} bytes free, "
                                  f"{headroom_bytes(free)} kept as headroom); enlarge it, or --no-peer-memory")
        os.ftruncate(fd, nbytes)
        try:
            os.posix_fallocate(fd, size, nbytes - size)
        except OSError as exc:
            os.ftruncate(fd, size)
            drain(sock, nbytes - HEADER_BYTES)
            raise CheckpointError(f"cannot grow {path} to {nbytes} bytes: {exc.strerror or exc}") from exc
    os.pwrite(fd, SlotHeader(SlotState.WRITING, 0, -1, 0, 0, 0, 0, 0, 0, 0).pack(), 0)


def verify(view: memoryview, h: SlotHeader, path: Path) -> None:
    """CheckpointCorrupt unless the slot bytes in ``view`` match the checksum table and meta of ``h``."""
    end = copy_bytes(h)
    table = bytes(view[h.table_off:end])
    if len(view) < end or zlib.crc32(table) != h.table_crc or h.n_chunks != len(hashed_ranges(h)):
        raise CheckpointCorrupt(f"{path}: peer copy of step {h.step}: its checksum table fails its crc32")
    expected = struct.unpack(f"<{h.n_chunks}Q", table)
    for k, (a, b) in enumerate(hashed_ranges(h)):
        if xxhash.xxh3_64_intdigest(view[a:b]) != expected[k]:
            raise CheckpointCorrupt(f"{path}: peer copy of step {h.step}: checksum mismatch in chunk {k} "
                                    f"(bytes {a}..{b})")
    try:
        meta = json.loads(bytes(view[h.meta_off:h.meta_off + h.meta_len]))
        ok = (meta["format"], meta["version"], meta["step"], meta["seq"]) == (META_FORMAT, VERSION, h.step, h.seq)
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointCorrupt(f"{path}: peer copy of step {h.step}: malformed meta ({exc})") from exc
    if not ok:
        raise CheckpointCorrupt(f"{path}: peer copy of step {h.step}: its meta disagrees with its header")
