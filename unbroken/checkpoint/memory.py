"""Memory tier of the checkpoint engine: the slot format and its writer (SnapshotWriter).

Files, in a tmpfs directory (`shm_dir`, /dev/shm by default), outlive a worker's SIGKILL:
    unbroken-{job_id}-r{rank:05d}-s{0,1}   the two slots of one rank, written by its worker
    unbroken-{job_id}.owner                the owning agent (names, ownership, clean-up: shm_files)
Slot layout: [0, 4096) header (magic, version, state, seq, step, offsets, the table's
crc32, its own crc32); tensor bytes at 64-byte aligned offsets; the JSON meta (flatten_state
spec, tensor index, user meta); then the checksum table: xxh3_64 of each CHUNK_BYTES of the
tensor bytes [4096, meta), then one of the meta. (Version 2; version 1 used crc32 over
tensors and meta together, 3-5x slower, and its slots read as invalid now.)

A slot's state goes EMPTY -> WRITING -> COPIED -> COMMITTED -> WRITING ... WRITING is stored
before the first byte of a snapshot, COPIED once tensors and meta are in place, COMMITTED only
after the checksum table and the checksummed header are. Tensors the caller names as *deferred*
(unchanged until it calls `settle`: parameters and optimizer state before the next update) are
copied by the commit thread while training goes on; the rest, and the meta, before `write`
returns. A snapshot with deferred tensors commits only once settled (the caller vouches that
they did not change during the copy); an unsettled one is abandoned, never committed. The
writer writes the slot not holding the newest committed snapshot, unless the other slot is held
for the persister: then it overwrites the newest, the held one staying committed meanwhile.
Either way a crash at any point leaves a committed snapshot intact. A reader pins the slot it reads (flock LOCK_SH); the writer
takes LOCK_EX from WRITING to COMMITTED and skips a snapshot whose slot is pinned rather than
wait. The agent owns the files' lifetime; the writer never deletes them.

This module is the one home of the format (constants, SlotState, the header, the ranges the
checksum table covers); the reading side, SnapshotReader and its verified load, is in
unbroken.checkpoint.memory_reader.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import json
import logging
import math
import mmap
import os
import struct
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Collection, NamedTuple

import torch
import xxhash

from unbroken.checkpoint.capacity import (  # noqa: F401  (the slot sizes, reachable as memory.*)
    CHUNK_BYTES, GROW_ROUND_BYTES, GROWTH, HEADER_BYTES, MIN_HEADROOM_BYTES, grown_slot_bytes, headroom_bytes)
from unbroken.checkpoint.sources import flatten_sources
from unbroken.checkpoint.shm_files import (check_dir, open_ours, open_slot, persisted_path, read_ours,
                                           read_persisted, slot_path)
from unbroken.errors import CheckpointError, ConfigError
from unbroken.state.dtypes import dtype_name
from unbroken.units import round_up

logger = logging.getLogger(__name__)

MAGIC, VERSION, META_FORMAT = b"UNBRKSHM", 2, "unbroken-shm-snapshot"
ALIGN_BYTES = 64
# magic, version, state, then SlotHeader's fields after state, then header_crc (over all of it
# but state and itself, so the state can change with one aligned 4-byte store).
HEADER = struct.Struct("<8sIIQqQQQQQQII")
_STATE, _STATE_OFFSET = struct.Struct("<I"), 12
HASH = struct.Struct("<Q")  # one checksum table entry: xxh3_64


class SlotState(enum.IntEnum):
    EMPTY = 0
    WRITING = 1
    COPIED = 2
    COMMITTED = 3


class SlotHeader(NamedTuple):
    state: int
    seq: int  # write order of the rank's snapshots
    step: int
    data_off: int
    meta_off: int
    meta_len: int
    table_off: int
    chunk_bytes: int
    n_chunks: int  # checksum table entries: the tensor chunks, then the meta
    table_crc: int  # crc32 of the table

    def pack(self) -> bytes:
        crc = zlib.crc32(HEADER.pack(MAGIC, VERSION, 0, *self[1:], 0))
        return HEADER.pack(MAGIC, VERSION, self.state, *self[1:], crc)

    @staticmethod
    def unpack(raw: bytes) -> SlotHeader | None:
        """The header in `raw`, or None unless it is ours, this version, and its crc matches."""
        if len(raw) < HEADER.size or raw[:8] != MAGIC:
            return None
        _, _, state, *fields, _ = HEADER.unpack_from(raw)
        header = SlotHeader(state, *fields)
        ok = state in SlotState._value2member_map_ and header.pack() == raw[:HEADER.size]
        return header if ok else None


def read_header(path: Path) -> SlotHeader | None:
    """The valid header of the slot file at `path`, or None (missing, not ours, torn)."""
    raw = read_ours(path, HEADER.size)
    return None if raw is None else SlotHeader.unpack(raw)


def hashed_ranges(h: SlotHeader) -> list[tuple[int, int]]:
    """The byte ranges of a slot its checksum table covers, in table order: CHUNK_BYTES
    chunks of the tensor bytes [data_off, meta_off), then the meta."""
    data = [(a, min(a + h.chunk_bytes, h.meta_off))
            for a in range(h.data_off, h.meta_off, h.chunk_bytes)]
    return data + [(h.meta_off, h.meta_off + h.meta_len)]


class SnapshotWriter:
    """Copies one rank's state into its two shared-memory slots; runs in the worker.

    Owns the two slot mappings and at most one commit thread (the deferred copies of the last
    write, its checksums, then COPIED -> COMMITTED once settled). `write` blocks for the wait on
    the previous commit plus the copy of what is not deferred; `settle` for the rest of the copy.
    Call them from one thread; one writer per rank (the agent makes sure an old worker of the
    rank is dead before it starts a new one). close() unmaps; the files stay.
    """

    def __init__(self, shm_dir: str | os.PathLike | None, job_id: str, rank: int, hold_every: int = 0) -> None:
        self.dir, self.job_id, self.rank = check_dir(shm_dir), job_id, rank
        self.paths = [slot_path(self.dir, job_id, rank, s) for s in (0, 1)]
        # Snapshots of steps divisible by hold_every are kept until the agent has persisted
        # them (mark_persisted): the writer then rotates through the other slot only.
        self.hold_every = hold_every
        self._persisted_path = persisted_path(self.dir, job_id, rank)
        self._maps: list[_Mapping | None] = [None, None]
        self._thread: threading.Thread | None = None
        self._pending: _Pending | None = None  # the commit thread's snapshot, until joined
        self._error: BaseException | None = None
        self.skipped_writes = 0  # snapshots skipped because a reader pinned the slot
        headers = [read_header(p) for p in self.paths]
        self._seq = max((h.seq for h in headers if h), default=0)  # a restarted worker continues
        done = [(h.seq, s, h.step) for s, h in enumerate(headers)
                if h and h.state == SlotState.COMMITTED]
        _, self._newest, self.committed_step = max(done) if done else (0, None, None)

    def write(self, step: int, state: Any, meta: dict | None = None, deferred: Collection[int] = ()) -> float:
        """Copy `state` into a slot (see _target_slot); return the seconds the caller was
        blocked (the wait for the previous commit, and the copy of what is not deferred).

        ``deferred``: ``data_ptr()`` of the state's tensors the caller will not change until it
        calls :meth:`settle`; the commit thread copies them meanwhile, and the snapshot commits
        only once settled. An earlier snapshot still unsettled is abandoned first (never
        committed: its tensors may have changed). A background thread commits the snapshot;
        `flush` waits for it. CheckpointError when the state or meta cannot be encoded,
        shm_dir lacks space, or the last commit failed; a committed snapshot is always left intact.
        """
        start = time.perf_counter()
        if type(step) is not int or step < 0:
            raise ConfigError(f"step must be an int >= 0, got {step!r}")
        self.abandon()
        self._wait_commit(None)
        sources, spec = flatten_sources(state)
        index, cursor = {}, HEADER_BYTES
        for name, (host, _) in sources.items():
            cursor, nbytes = round_up(cursor, ALIGN_BYTES), host.numel() * host.element_size()
            index[name] = {"dtype": dtype_name(host.dtype),
                           "shape": list(host.shape), "offset": cursor, "nbytes": nbytes}
            cursor += nbytes
        self._seq += 1
        try:
            meta_bytes = json.dumps({"format": META_FORMAT, "version": VERSION, "step": step,
                                     "seq": self._seq, "job_id": self.job_id, "rank": self.rank,
                                     "spec": spec, "tensors": index, "meta": dict(meta or {})},
                                    allow_nan=False, separators=(",", ":")).encode()
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"meta of rank {self.rank} step {step} is not JSON-serializable:"
                                  f" {exc}") from exc
        meta_off = round_up(cursor, ALIGN_BYTES)
        table_off = round_up(meta_off + len(meta_bytes), ALIGN_BYTES)
        n_chunks = math.ceil((meta_off - HEADER_BYTES) / CHUNK_BYTES) + 1
        slot = self._target_slot()
        if slot is None:
            self.skipped_writes += 1
            logger.warning("rank %d: skipped the shared-memory snapshot of step %d: both slots hold "
                           "snapshots the agent has not persisted yet", self.rank, step)
            return time.perf_counter() - start
        fd = self._lock(slot)  # held until the commit is done
        if fd is None:
            self.skipped_writes += 1
            logger.warning("rank %d: skipped the shared-memory snapshot of step %d: a reader "
                           "(the agent) still reads the older snapshot in %s", self.rank, step,
                           self.paths[slot])
            return time.perf_counter() - start
        try:
            m = self._ensure(slot, fd, table_off + HASH.size * n_chunks)
            _STATE.pack_into(m.mm, _STATE_OFFSET, SlotState.WRITING)  # first store of a snapshot
            header = SlotHeader(SlotState.WRITING, self._seq, step, HEADER_BYTES, meta_off,
                             len(meta_bytes), table_off, CHUNK_BYTES, n_chunks, 0)
            m.mm[:HEADER.size] = header.pack()
            later = []
            for name, (_, src) in sources.items():
                e = index[name]
                # On a GPU `src` is a CUDA tensor: one device-to-host copy into the pageable
                # mapping. Later step: register the mapping as pinned memory (cudaHostRegister),
                # copy with non_blocking=True, and have the commit thread wait on a CUDA event.
                dst = m.buf[e["offset"]:e["offset"] + e["nbytes"]].view(src.dtype).view(src.shape)
                if src.numel() and src.data_ptr() in deferred:
                    later.append((dst, src))
                else:
                    dst.copy_(src)
            m.mm[meta_off:meta_off + len(meta_bytes)] = meta_bytes
            self._pending = _Pending(later)
            self._thread = threading.Thread(target=self._commit, args=(m, fd, slot, header, self._pending),
                                            daemon=True, name=f"unbroken-snapshot-r{self.rank}")
            self._thread.start()
        except BaseException:
            os.close(fd)
            raise
        return time.perf_counter() - start

    def _lock(self, slot: int) -> int | None:
        """An fd of ``slot`` holding its exclusive flock, or None while a reader pins it."""
        fd = open_slot(self.paths[slot])
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    def _target_slot(self) -> int | None:
        """The slot to write: not the newest committed one, unless the other is held for the
        persister (then the newest is overwritten; the held one stays committed meanwhile)."""
        if self._newest is None:
            return 0
        other = 1 - self._newest
        held = [self._held(s) for s in (0, 1)]
        if not held[other]:
            return other
        return None if held[self._newest] else self._newest

    def _held(self, slot: int) -> bool:
        """Kept for the persister: the newest committed snapshot due to persist and not yet taken.
        Only the newest is kept (the persister skips stale ones), so a persister slower than
        --persist-every-steps holds one slot at most and the memory tier goes on in the other."""
        if not self.hold_every:
            return False
        taken = read_persisted(self._persisted_path)
        due = []
        for path in self.paths:
            h = read_header(path)
            ok = h is not None and h.state == SlotState.COMMITTED and h.step % self.hold_every == 0 and h.step > taken
            due.append(h.step if ok else -1)
        return due[slot] >= 0 and due[slot] == max(due)

    @property
    def unsettled(self) -> bool:
        """A snapshot with deferred tensors is pending and not settled yet."""
        return self._pending is not None and not self._pending.go.is_set()

    def settle(self, timeout_s: float | None = None) -> bool:
        """Wait until the deferred tensors of the pending snapshot are copied (the caller may
        change them after this returns True), and let its commit go on. False if the copy still
        runs after `timeout_s` (the snapshot stays unsettled). An error of the copy is raised
        by the next write, flush or close."""
        pending = self._pending
        if pending is None or pending.go.is_set():
            return True
        if not pending.copied.wait(timeout_s):
            return False
        pending.go.set()
        return True

    def abandon(self) -> None:
        """Never commit the pending snapshot if it is unsettled: its deferred tensors may have
        changed (a step ended without the update the caller would settle at). Its slot stays
        uncommitted; the committed snapshot before it stays the newest."""
        pending = self._pending
        if pending is not None and not pending.go.is_set():
            pending.abandoned = True
            pending.go.set()
            logger.info("rank %d: abandoned an unsettled shared-memory snapshot (it stays uncommitted)", self.rank)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Settle the pending snapshot (the caller vouches that its deferred tensors did not
        change) and wait for its commit; False if it still runs after `timeout_s`.
        Raises CheckpointError if it failed."""
        if not self.settle(timeout_s):
            return False
        return self._wait_commit(timeout_s)

    def close(self) -> None:
        """Abandon an unsettled snapshot, wait for the pending commit, then unmap the slots (the
        files stay)."""
        try:
            self.abandon()
            self._wait_commit(None)
        finally:
            for m in self._maps:
                if m is not None:
                    m.close()
            self._maps = [None, None]

    def _commit(self, m: _Mapping, fd: int, slot: int, header: SlotHeader, pending: _Pending) -> None:
        """Commit thread: the deferred copies, COPIED, checksum table, checksummed header; once
        settled the state COMMITTED; unpin."""
        if all(src.is_cpu for _, src in pending.later):  # a CPU job: its step's threads own the cores
            _yield_to_training()
        try:
            try:
                for dst, src in pending.later:
                    dst.copy_(src)
                header = header._replace(state=SlotState.COPIED)
                m.mm[:HEADER.size] = header.pack()
            finally:
                pending.later = []  # drop the references to the live tensors
                pending.copied.set()
            with memoryview(m.mm) as view:
                hashes = [xxhash.xxh3_64_intdigest(view[a:b]) for a, b in hashed_ranges(header)]
            table = struct.pack(f"<{len(hashes)}Q", *hashes)
            m.mm[header.table_off:header.table_off + len(table)] = table
            m.mm[:HEADER.size] = header._replace(table_crc=zlib.crc32(table)).pack()
            pending.go.wait()
            if not pending.abandoned:
                _STATE.pack_into(m.mm, _STATE_OFFSET, SlotState.COMMITTED)  # the commit point
                self._newest, self.committed_step = slot, header.step
        except BaseException as exc:  # re-raised in the training thread by _wait_commit
            self._error = exc
        finally:
            os.close(fd)  # drops the flock

    def _wait_commit(self, timeout_s: float | None) -> bool:
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                return False
            self._thread, self._pending = None, None
        if self._error is not None:
            exc, self._error = self._error, None
            raise CheckpointError(f"committing the shared-memory snapshot of rank {self.rank} "
                                  f"(job {self.job_id!r}) failed: {exc}") from exc
        return True

    def _ensure(self, slot: int, fd: int, needed: int) -> _Mapping:
        """The mapping of `slot`, at least `needed` bytes, every page touched.

        A slot too small grows to needed * GROWTH: fallocate (a full shm_dir fails here with
        ENOSPC, not as a SIGBUS in the copy), then a pre-touch so the copy never page-faults.
        """
        m = self._maps[slot]
        if m is not None and m.capacity >= needed:
            return m
        if m is not None:
            m.close()
            self._maps[slot] = None
        size = os.fstat(fd).st_size
        if size >= HEADER.size:  # it may hold the older snapshot: unlist it first
            os.pwrite(fd, _STATE.pack(SlotState.WRITING), _STATE_OFFSET)
        if size < needed:
            new_size = grown_slot_bytes(needed)
            self._check_capacity(slot, size, new_size)
            os.ftruncate(fd, new_size)
            try:
                os.posix_fallocate(fd, size, new_size - size)
            except OSError as exc:
                os.ftruncate(fd, size)
                raise CheckpointError(
                    f"cannot grow {self.paths[slot]} from {size} to {new_size} bytes: "
                    f"{exc.strerror or exc}; enlarge {self.dir} or snapshot less state") from exc
            size = new_size
        m = _Mapping(self.paths[slot], size, fd)
        m.buf[HEADER_BYTES:].zero_()  # pre-touch: the page faults happen here, not in the copy
        if SlotHeader.unpack(m.mm[:HEADER.size]) is None:  # a new file
            m.mm[:HEADER.size] = SlotHeader(SlotState.EMPTY, 0, -1, 0, 0, 0, 0, 0, 0, 0).pack()
        self._maps[slot] = m
        return m

    def _check_capacity(self, slot: int, size: int, new_size: int) -> None:
        """CheckpointError unless both slots can reach `new_size` bytes with headroom left."""
        try:
            other = os.lstat(self.paths[1 - slot]).st_size
        except FileNotFoundError:
            other = 0
        add = (new_size - size) + max(0, new_size - other)
        st = os.statvfs(self.dir)
        free = st.f_bavail * st.f_frsize
        headroom = headroom_bytes(free)
        if add + headroom > free:
            raise CheckpointError(
                f"shared-memory snapshots of rank {self.rank} (job {self.job_id!r}) need {add} "
                f"bytes ({_gib(add)}) more in {self.dir} for two slots of {_gib(new_size)}, but "
                f"{free} bytes ({_gib(free)}) are free there and {_gib(headroom)} are kept as "
                "headroom. Lower the snapshot frequency or size (less state per rank), or enlarge"
                f" {self.dir} (`mount -o remount,size=... {self.dir}`, docker --shm-size).")


# ---- helpers -----------------------------------------------------------------------


def _yield_to_training() -> None:
    """A CPU job's commit thread at nice 19 (this thread only; Linux): it takes the gaps of the cores
    the step's threads keep busy (benchmarks/snapshot_overlap.py). Not a GPU job's: data loaders
    would starve it while the update waits."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class _Pending:
    """One snapshot's hand-over between the training thread and its commit thread: the deferred
    (destination, live source) copies, set `copied` once they are done, `go` once the snapshot
    may commit (settled) or must not (`abandoned`)."""

    def __init__(self, later: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.later, self.abandoned = later, False
        self.copied, self.go = threading.Event(), threading.Event()
        if not later:  # everything was copied at the boundary: nothing to settle
            self.go.set()


class _Mapping:
    """One slot file mapped shared and writable; `buf` is a uint8 tensor over all of it."""

    def __init__(self, path: Path, size: int, locked_fd: int) -> None:
        # Its own open file: mmap keeps a dup of the fd, which must not share the writer's flock.
        # It must be the very file `locked_fd` holds, not one put in its place meanwhile.
        fd = open_ours(path, os.O_RDWR)
        if fd is None or not os.path.samestat(os.fstat(fd), os.fstat(locked_fd)):
            if fd is not None:
                os.close(fd)
            raise CheckpointError(f"{path} was replaced while this rank wrote it: another "
                                  f"process interferes with {path.parent}; use a private --shm-dir")
        try:
            self.mm, self.capacity = mmap.mmap(fd, size), size
        finally:
            os.close(fd)
        self.buf: torch.Tensor = torch.frombuffer(self.mm, dtype=torch.uint8)

    def close(self) -> None:
        del self.buf  # drop the buffer export first, or mmap.close raises BufferError
        _close_map(self.mm)


def _close_map(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:  # a view is still alive (held by a traceback): the GC unmaps it
        pass


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"
