"""Memory tier of the checkpoint engine: per-rank snapshots in shared-memory slot files.

Files, in a tmpfs directory (`shm_dir`, /dev/shm by default), outlive a worker's SIGKILL:
    unbroken-{job_id}-r{rank:05d}-s{0,1}   the two slots of one rank, written by its worker
    unbroken-{job_id}.owner                the owning agent (names, ownership, clean-up: shm_files)
Slot layout: [0, 4096) header (magic, version, state, seq, step, offsets, the table's
crc32, its own crc32); tensor bytes at 64-byte aligned offsets; the JSON meta (flatten_state
spec, tensor index, user meta); then the checksum table: xxh3_64 of each CHUNK_BYTES of the
tensor bytes [4096, meta), then one of the meta. (Version 2; version 1 used crc32 over
tensors and meta together, 3-5x slower, and its slots read as invalid now.)

A slot's state goes EMPTY -> WRITING -> COPIED -> COMMITTED -> WRITING ... WRITING is stored
before the first byte of a snapshot, COPIED once tensors and meta are in place (the training
step resumes there), COMMITTED only after the checksum table and the checksummed header are. The
writer always writes the slot not holding the newest committed snapshot, so a crash at any
point leaves that one intact. A reader pins the slot it reads (flock LOCK_SH); the writer
takes LOCK_EX from WRITING to COMMITTED and skips a snapshot whose slot is pinned rather than
wait. The agent owns the files' lifetime; the writer never deletes them.
"""

from __future__ import annotations

import ctypes
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
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import torch
import xxhash

from unbroken.checkpoint.codec import flatten_state, unflatten_state
from unbroken.checkpoint.shm_files import _check_dir, _open_slot, persisted_path, read_persisted, slot_path
from unbroken.errors import CheckpointCorrupt, CheckpointError, ConfigError, NoCheckpoint

logger = logging.getLogger(__name__)

MAGIC, VERSION, META_FORMAT = b"UNBRKSHM", 2, "unbroken-shm-snapshot"
HEADER_BYTES = 4096  # tensor data starts on the second page
ALIGN_BYTES = 64
CHUNK_BYTES = 16 << 20  # checksum granularity: chunks verify (and copy) in parallel on load
PIECE_BYTES = 512 << 10  # a load reads this much, then hashes it while it is still in cache
GROWTH, GROW_ROUND_BYTES = 1.25, 2 << 20  # a slot too small grows to needed * 1.25, once
MIN_HEADROOM_BYTES = 256 << 20  # left free in shm_dir: max(this, 10% of the free bytes)
# magic, version, state, then _Header's fields after state, then header_crc (over all of it
# but state and itself, so the state can change with one aligned 4-byte store).
_HEADER = struct.Struct("<8sIIQqQQQQQQII")
_STATE, _STATE_OFFSET = struct.Struct("<I"), 12
_HASH = struct.Struct("<Q")  # one checksum table entry: xxh3_64


class SlotState(enum.IntEnum):
    EMPTY = 0
    WRITING = 1
    COPIED = 2
    COMMITTED = 3


class _Header(NamedTuple):
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
        crc = zlib.crc32(_HEADER.pack(MAGIC, VERSION, 0, *self[1:], 0))
        return _HEADER.pack(MAGIC, VERSION, self.state, *self[1:], crc)

    @staticmethod
    def unpack(raw: bytes) -> _Header | None:
        """The header in `raw`, or None unless it is ours, this version, and its crc matches."""
        if len(raw) < _HEADER.size or raw[:8] != MAGIC:
            return None
        _, _, state, *fields, _ = _HEADER.unpack_from(raw)
        header = _Header(state, *fields)
        ok = state in SlotState._value2member_map_ and header.pack() == raw[:_HEADER.size]
        return header if ok else None


class SnapshotWriter:
    """Copies one rank's state into its two shared-memory slots; runs in the worker.

    Owns the two slot mappings and at most one commit thread (checksums of the last write, then
    COPIED -> COMMITTED). `write` blocks for the wait on the previous commit plus the copy.
    Call it from one thread; one writer per rank (the agent makes sure an old worker of the
    rank is dead before it starts a new one). close() unmaps; the files stay.
    """

    def __init__(self, shm_dir: str | os.PathLike | None, job_id: str, rank: int, hold_every: int = 0) -> None:
        self.dir, self.job_id, self.rank = _check_dir(shm_dir), job_id, rank
        self.paths = [slot_path(self.dir, job_id, rank, s) for s in (0, 1)]
        # Snapshots of steps divisible by hold_every are kept until the agent has persisted
        # them (mark_persisted): the writer then rotates through the other slot only.
        self.hold_every = hold_every
        self._persisted_path = persisted_path(self.dir, job_id, rank)
        self._maps: list[_Mapping | None] = [None, None]
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.skipped_writes = 0  # snapshots skipped because a reader pinned the slot
        headers = [_read_header(p) for p in self.paths]
        self._seq = max((h.seq for h in headers if h), default=0)  # a restarted worker continues
        done = [(h.seq, s, h.step) for s, h in enumerate(headers)
                if h and h.state == SlotState.COMMITTED]
        _, self._newest, self.committed_step = max(done) if done else (0, None, None)

    def write(self, step: int, state: Any, meta: dict | None = None) -> float:
        """Copy `state` into the slot not holding the newest committed snapshot; return the
        seconds the caller was blocked (the wait for the previous commit, and the copy).

        A background thread commits the snapshot; `flush` waits for it. CheckpointError when
        the state or meta cannot be encoded, shm_dir lacks space, or the last commit failed;
        the newest committed snapshot is never touched.
        """
        start = time.perf_counter()
        if type(step) is not int or step < 0:
            raise ConfigError(f"step must be an int >= 0, got {step!r}")
        self._wait_commit(None)
        sources, spec = _flatten_sources(state)
        index, cursor = {}, HEADER_BYTES
        for name, (host, _) in sources.items():
            cursor, nbytes = _round_up(cursor, ALIGN_BYTES), host.numel() * host.element_size()
            index[name] = {"dtype": str(host.dtype).removeprefix("torch."),
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
        meta_off = _round_up(cursor, ALIGN_BYTES)
        table_off = _round_up(meta_off + len(meta_bytes), ALIGN_BYTES)
        n_chunks = math.ceil((meta_off - HEADER_BYTES) / CHUNK_BYTES) + 1
        slot = self._target_slot()
        if slot is None:
            self.skipped_writes += 1
            logger.warning("rank %d: skipped the shared-memory snapshot of step %d: both slots hold "
                           "snapshots the agent has not persisted yet", self.rank, step)
            return time.perf_counter() - start
        fd = self._lock(slot)  # held until the commit is done
        if fd is None and self._newest not in (None, slot) and not self._held(self._newest):
            # The agent still reads the older snapshot: rewrite the newest instead (the one
            # being read stays committed and intact meanwhile).
            slot = self._newest
            fd = self._lock(slot)
        if fd is None:
            self.skipped_writes += 1
            logger.warning("rank %d: skipped the shared-memory snapshot of step %d: a reader "
                           "(the agent) still reads the older snapshot in %s", self.rank, step,
                           self.paths[slot])
            return time.perf_counter() - start
        try:
            m = self._ensure(slot, fd, table_off + _HASH.size * n_chunks)
            _STATE.pack_into(m.mm, _STATE_OFFSET, SlotState.WRITING)  # first store of a snapshot
            header = _Header(SlotState.WRITING, self._seq, step, HEADER_BYTES, meta_off,
                             len(meta_bytes), table_off, CHUNK_BYTES, n_chunks, 0)
            m.mm[:_HEADER.size] = header.pack()
            for name, (_, src) in sources.items():
                e = index[name]
                # On a GPU `src` is a CUDA tensor: one device-to-host copy into the pageable
                # mapping. Later step: register the mapping as pinned memory (cudaHostRegister),
                # copy with non_blocking=True, and have the commit thread wait on a CUDA event.
                dst = m.buf[e["offset"]:e["offset"] + e["nbytes"]]
                dst.view(src.dtype).view(src.shape).copy_(src)
            m.mm[meta_off:meta_off + len(meta_bytes)] = meta_bytes
            header = header._replace(state=SlotState.COPIED)
            m.mm[:_HEADER.size] = header.pack()
            self._thread = threading.Thread(target=self._commit, args=(m, fd, slot, header),
                                            daemon=True, name=f"unbroken-snapshot-r{self.rank}")
            self._thread.start()
        except BaseException:
            os.close(fd)
            raise
        return time.perf_counter() - start

    def _lock(self, slot: int) -> int | None:
        """An fd of ``slot`` holding its exclusive flock, or None while a reader pins it."""
        fd = _open_slot(self.paths[slot])
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
            h = _read_header(path)
            ok = h is not None and h.state == SlotState.COMMITTED and h.step % self.hold_every == 0 and h.step > taken
            due.append(h.step if ok else -1)
        return due[slot] >= 0 and due[slot] == max(due)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for the pending commit; False if it still runs after `timeout_s`.
        Raises CheckpointError if it failed."""
        return self._wait_commit(timeout_s)

    def close(self) -> None:
        """Wait for the pending commit, then unmap the slots (the files stay)."""
        try:
            self._wait_commit(None)
        finally:
            for m in self._maps:
                if m is not None:
                    m.close()
            self._maps = [None, None]

    def _commit(self, m: _Mapping, fd: int, slot: int, header: _Header) -> None:
        """Commit thread: checksum table, checksummed header, the state COMMITTED, unpin."""
        try:
            with memoryview(m.mm) as view:
                hashes = [xxhash.xxh3_64_intdigest(view[a:b]) for a, b in _hashed_ranges(header)]
            table = struct.pack(f"<{len(hashes)}Q", *hashes)
            m.mm[header.table_off:header.table_off + len(table)] = table
            m.mm[:_HEADER.size] = header._replace(table_crc=zlib.crc32(table)).pack()
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
            self._thread = None
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
        if size >= _HEADER.size:  # it may hold the older snapshot: unlist it first
            os.pwrite(fd, _STATE.pack(SlotState.WRITING), _STATE_OFFSET)
        if size < needed:
            new_size = _round_up(math.ceil(needed * GROWTH), GROW_ROUND_BYTES)
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
        m = _Mapping(self.paths[slot], size)
        m.buf[HEADER_BYTES:].zero_()  # pre-touch: the page faults happen here, not in the copy
        if _Header.unpack(m.mm[:_HEADER.size]) is None:  # a new file
            m.mm[:_HEADER.size] = _Header(SlotState.EMPTY, 0, -1, 0, 0, 0, 0, 0, 0, 0).pack()
        self._maps[slot] = m
        return m

    def _check_capacity(self, slot: int, size: int, new_size: int) -> None:
        """CheckpointError unless both slots can reach `new_size` bytes with headroom left."""
        other = self.paths[1 - slot].stat().st_size if self.paths[1 - slot].exists() else 0
        add = (new_size - size) + max(0, new_size - other)
        st = os.statvfs(self.dir)
        free = st.f_bavail * st.f_frsize
        headroom = max(free // 10, MIN_HEADROOM_BYTES)
        if add + headroom > free:
            raise CheckpointError(
                f"shared-memory snapshots of rank {self.rank} (job {self.job_id!r}) need {add} "
                f"bytes ({_gib(add)}) more in {self.dir} for two slots of {_gib(new_size)}, but "
                f"{free} bytes ({_gib(free)}) are free there and {_gib(headroom)} are kept as "
                "headroom. Lower the snapshot frequency or size (less state per rank), or enlarge"
                f" {self.dir} (`mount -o remount,size=... {self.dir}`, docker --shm-size).")


class SnapshotReader:
    """Reads one rank's committed snapshots; runs in the agent or in a restarted worker.

    Holds nothing between calls: each read pins the newest committed slot (flock LOCK_SH;
    the writer never rewrites a pinned slot), reads its tensors with pread (no mapping, no
    page faults on the slot) straight into their destinations, hashing each piece right after
    it lands, and unpins. Safe while the writer runs: the writer only locks a slot it
    rewrites, and such a slot is never the newest committed one.
    """

    def __init__(self, shm_dir: str | os.PathLike | None, job_id: str, rank: int) -> None:
        self.dir, self.job_id, self.rank = _check_dir(shm_dir), job_id, rank
        self.paths = [slot_path(self.dir, job_id, rank, s) for s in (0, 1)]

    def slots(self) -> list[dict]:
        """Per slot: slot, path, bytes, state (SlotState name, MISSING or INVALID), step, seq."""
        out = []
        for slot, path in enumerate(self.paths):
            size, h = (path.stat().st_size if path.exists() else None), _read_header(path)
            state = SlotState(h.state).name if h else "MISSING" if size is None else "INVALID"
            out.append({"slot": slot, "path": path, "bytes": size, "state": state,
                        "step": h.step if h else None, "seq": h.seq if h else None})
        return out

    def committed(self) -> list[tuple[int, int]]:
        """(step, slot) of the committed slots, newest first (by write order: the step order,
        except after a rollback, where the snapshots written since count as newer)."""
        return [(h.step, slot) for slot, h in self._committed_headers()]

    def read_flat(self, step: int | None = None, into: dict[str, torch.Tensor] | None = None
                  ) -> tuple[dict[str, torch.Tensor], dict, dict]:
        """(tensors, spec, user meta) of the newest committed snapshot, or of `step`.

        Tensors are new, except where `into` ({tensor name: tensor}, names as in the
        snapshot) holds a CPU contiguous tensor of the stored dtype and shape: that one is
        filled in place and returned. Every byte returned is verified against its checksum
        first. Without `step`, a snapshot failing its checksum is skipped with a warning and
        the older one returned; with `step`, CheckpointCorrupt names the file. NoCheckpoint
        when no (such) snapshot is committed. On any error, and after a skipped snapshot,
        tensors of `into` may hold partly overwritten bytes.
        """
        return self._read(step, lambda spec: into or {})

    def load(self, step: int | None = None, into: Any = None) -> tuple[Any, dict]:
        """(state tree, user meta) of the newest committed snapshot, or of `step`.

        `into`: a tree shaped like the one written (e.g. the state of a freshly built model
        and optimizer). Each snapshot tensor whose leaf at the same place in `into` is a CPU
        contiguous tensor of the same dtype and shape is read straight into that leaf, with no
        allocation, and the returned tree holds that very tensor (a view of it for dtypes
        stored as raw bytes); the others (no such leaf, another shape or dtype) come back as
        new tensors, and `into`'s other leaves are ignored. On CheckpointCorrupt (and whenever
        a newer snapshot was skipped) tensors of `into` may be partly overwritten: load
        another step into them, or trust only the returned tree. Otherwise as read_flat.
        """
        tensors, spec, meta = self._read(step, lambda spec: _into_targets(spec, into))
        return unflatten_state(tensors, spec), meta

    def _read(self, step: int | None, targets: Callable[[dict], dict[str, torch.Tensor]]
              ) -> tuple[dict[str, torch.Tensor], dict, dict]:
        skip: set[int] = set()
        errors: list[CheckpointCorrupt] = []
        while (pin := self._pin(step, skip)) is not None:
            slot, fd, header = pin
            try:
                return _read_slot(self.paths[slot], fd, header, targets)
            except CheckpointCorrupt as exc:
                if step is not None:
                    raise
                logger.warning("skipping the shared-memory snapshot of step %d of rank %d: %s",
                               header.step, self.rank, exc)
                errors.append(exc)
                skip.add(slot)
            finally:
                os.close(fd)  # unpins
        if errors:
            raise errors[0]
        raise NoCheckpoint(
            f"no committed shared-memory snapshot{'' if step is None else f' of step {step}'} for "
            f"rank {self.rank} of job {self.job_id!r} in {self.dir} (committed: "
            f"{[s for s, _ in self.committed()]})")

    def _committed_headers(self) -> list[tuple[int, _Header]]:
        found = [(slot, h) for slot, p in enumerate(self.paths)
                 if (h := _read_header(p)) is not None and h.state == SlotState.COMMITTED]
        return sorted(found, key=lambda item: item[1].seq, reverse=True)

    def _pin(self, step: int | None, skip: set[int]) -> tuple[int, int, _Header] | None:
        """Pin the newest committed slot (of `step`) not in `skip`: (slot, fd holding the pin,
        header). Pinning comes before reading the header, so the header read stays true."""
        pins = []
        for slot, path in enumerate(self.paths):
            if slot in skip:
                continue
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                h = _Header.unpack(os.pread(fd, _HEADER.size, 0))
            except BlockingIOError:  # the writer is rewriting it: not committed
                h = None
            if h and h.state == SlotState.COMMITTED and step in (None, h.step):
                pins.append((h.seq, slot, fd, h))
            else:
                os.close(fd)
        pins.sort(key=lambda p: p[0], reverse=True)
        for _, _, fd, _ in pins[1:]:
            os.close(fd)
        return pins[0][1:] if pins else None


# ---- helpers -----------------------------------------------------------------------


class _Mapping:
    """One slot file mapped shared and writable; `buf` is a uint8 tensor over all of it."""

    def __init__(self, path: Path, size: int) -> None:
        # Its own open file: mmap keeps a dup of the fd, which must not share the writer's flock.
        fd = os.open(path, os.O_RDWR)
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


def _is_host(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def _flatten_sources(state: Any) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict]:
    """flatten_state as {name: (host layout, source tensor)}, without staging copies.

    flatten_state would copy a device (or non-contiguous) tensor into fresh host memory: a
    copy plus page faults. Instead each such tensor stands in, while flattening, as an
    untouched host placeholder of its shape and dtype, and its bytes go straight from the
    device into the slot. The host layout (dtype, shape) is what flatten_state recorded.
    """
    stand_ins: dict[tuple, torch.Tensor] = {}  # view of a device storage -> placeholder
    origin: dict[int, torch.Tensor] = {}  # placeholder data_ptr -> device tensor

    def swap(x: Any) -> Any:
        kind = type(x)
        if kind in (dict, OrderedDict):
            out = kind((k, swap(v)) for k, v in x.items())
            if hasattr(x, "_metadata"):
                out._metadata = x._metadata
            return out
        if kind in (list, tuple):
            return kind(swap(v) for v in x)
        if kind in (torch.Tensor, torch.nn.Parameter) and x.numel() > 0 and not x.is_quantized \
                and x.layout == torch.strided and x.device.type != "meta" \
                and not (_is_host(x) and x.is_contiguous()):
            key = (str(x.device), x.untyped_storage().data_ptr(), x.storage_offset(),
                   tuple(x.shape), x.stride(), x.dtype)
            if key not in stand_ins:  # tied weights share one placeholder: stored once
                stand_ins[key] = torch.empty(x.shape, dtype=x.dtype)
                origin[stand_ins[key].data_ptr()] = x.detach()
            return stand_ins[key]
        return x

    tensors, spec = flatten_state(swap(state))
    return {name: (t, origin.get(t.data_ptr(), t) if t.numel() else t)
            for name, t in tensors.items()}, spec


def _hashed_ranges(h: _Header) -> list[tuple[int, int]]:
    """The byte ranges of a slot its checksum table covers, in table order: CHUNK_BYTES
    chunks of the tensor bytes [data_off, meta_off), then the meta."""
    data = [(a, min(a + h.chunk_bytes, h.meta_off))
            for a in range(h.data_off, h.meta_off, h.chunk_bytes)]
    return data + [(h.meta_off, h.meta_off + h.meta_len)]


def _read_slot(path: Path, fd: int, h: _Header, targets: Callable[[dict], dict]
               ) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """Verify and read a pinned slot: (tensors, spec, meta). The table and the meta are
    checked first; the tensor bytes are checked as they are read into their destinations
    (`targets(spec)`, else new tensors), and nothing is returned unless all of them match."""
    end = h.table_off + _HASH.size * h.n_chunks
    size = os.fstat(fd).st_size
    if size < end or not HEADER_BYTES <= h.data_off <= h.meta_off <= h.table_off \
            or h.chunk_bytes <= 0 or h.n_chunks != len(_hashed_ranges(h)):
        raise CheckpointCorrupt(f"{path}: truncated or malformed: {size} bytes, its header "
                                f"(step {h.step}) says {end}")
    table = os.pread(fd, end - h.table_off, h.table_off)
    if zlib.crc32(table) != h.table_crc:
        raise CheckpointCorrupt(f"{path}: the checksum table of step {h.step} fails its crc32")
    expected = struct.unpack(f"<{h.n_chunks}Q", table)
    raw = os.pread(fd, h.meta_len, h.meta_off)
    if xxhash.xxh3_64_intdigest(raw) != expected[-1]:
        raise CheckpointCorrupt(f"{path}: checksum mismatch in the meta of the snapshot of "
                                f"step {h.step} ({h.meta_len} bytes from byte {h.meta_off})")
    meta = _parse_meta(path, raw, h)
    tensors, regions = _plan_reads(path, meta["tensors"], targets(meta["spec"]), h)
    bad = _read_verified(path, fd, h, regions, expected[:-1])
    if bad:
        raise CheckpointCorrupt(f"{path}: checksum mismatch in the snapshot of step {h.step}: "
                                f"chunk(s) {bad} of {h.n_chunks - 1} ({h.chunk_bytes} bytes each "
                                f"from byte {h.data_off})")
    return tensors, meta["spec"], meta["meta"]


def _plan_reads(path: Path, index: dict, targets: dict[str, torch.Tensor], h: _Header
                ) -> tuple[dict[str, torch.Tensor], list[tuple[int, int, memoryview | None]]]:
    """(tensors to return, regions): regions cover [data_off, meta_off) in order, each
    (offset, bytes, writable view of its destination, or None for alignment padding).

    A target is used when it is a plain CPU contiguous tensor of the stored dtype and shape
    that overlaps no other target (two snapshot tensors must not land in one memory)."""
    entries = sorted(index.items(), key=lambda item: item[1]["offset"])
    used = {name: t for name, e in entries if e["nbytes"]
            and _fits(t := targets.get(name), getattr(torch, e["dtype"]), e["shape"])}
    end = 0
    for name, t in sorted(used.items(), key=lambda item: item[1].data_ptr()):
        if t.data_ptr() < end:  # overlaps the one before it in memory: use a new tensor
            del used[name]
        else:
            end = t.data_ptr() + index[name]["nbytes"]
    tensors: dict[str, torch.Tensor] = {}
    regions: list[tuple[int, int, memoryview | None]] = []
    cursor = h.data_off
    for name, e in entries:
        if e["offset"] < cursor:
            raise CheckpointCorrupt(f"{path}: tensor {name!r} overlaps the one before it")
        if e["offset"] > cursor:
            regions.append((cursor, e["offset"] - cursor, None))
        dst = used.get(name)
        if dst is None:
            dst = torch.empty(e["shape"], dtype=getattr(torch, e["dtype"]))
        if e["nbytes"]:
            # A writable view of the tensor's memory for os.preadv, without numpy.
            raw = (ctypes.c_ubyte * e["nbytes"]).from_address(dst.data_ptr())
            regions.append((e["offset"], e["nbytes"], memoryview(raw).cast("B")))
        tensors[name], cursor = dst, e["offset"] + e["nbytes"]
    if h.meta_off > cursor:
        regions.append((cursor, h.meta_off - cursor, None))
    return tensors, regions


def _fits(t: Any, dtype: torch.dtype, shape: list[int]) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu" \
        and t.layout == torch.strided and t.dtype == dtype and list(t.shape) == shape \
        and t.is_contiguous() and not t.is_conj() and not t.is_neg()


def _read_verified(path: Path, fd: int, h: _Header, regions: list, expected: tuple[int, ...]
                   ) -> list[int]:
    """Read `regions` into their destinations and hash them, each CHUNK_BYTES chunk in one
    worker thread and PIECE_BYTES at a time (hashed while still in cache; pread and xxhash
    release the GIL); the indices of the chunks whose hash is not `expected`."""
    chunks: list[list[tuple[int, int, memoryview | None]]] = [[] for _ in expected]
    for offset, nbytes, view in regions:  # cut the regions at the chunk bounds
        pos, stop = offset, offset + nbytes
        while pos < stop:
            k = (pos - h.data_off) // h.chunk_bytes
            cut = min(stop, h.data_off + (k + 1) * h.chunk_bytes)
            chunks[k].append((pos, cut - pos, None if view is None else view[pos - offset:cut - offset]))
            pos = cut
    failed = threading.Event()  # one bad chunk is enough: the others stop early

    def verify(k: int) -> bool:
        hasher = xxhash.xxh3_64()
        for offset, nbytes, view in chunks[k]:
            for a in range(0, nbytes, PIECE_BYTES):
                if failed.is_set():
                    return True
                n = min(PIECE_BYTES, nbytes - a)
                piece = os.pread(fd, n, offset + a) if view is None else view[a:a + n]
                if (len(piece) if view is None else os.preadv(fd, [piece], offset + a)) != n:
                    raise CheckpointCorrupt(f"{path}: truncated at byte {offset + a} while "
                                            f"reading the snapshot of step {h.step}")
                hasher.update(piece)
        if hasher.intdigest() != expected[k]:
            failed.set()
            return False
        return True

    workers = min(4, os.cpu_count() or 1, len(chunks))
    if workers <= 1:
        ok = [verify(k) for k in range(len(chunks))]
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="unbroken-shm-read") as pool:
            ok = list(pool.map(verify, range(len(chunks))))
    return [k for k, good in enumerate(ok) if not good]


def _into_targets(spec: dict, into: Any) -> dict[str, Any]:
    """{snapshot tensor name: the tensor at the same place in `into`}, walking the spec of
    flatten_state and `into` together (a dtype stored as raw bytes: a uint8 view of it)."""
    out: dict[str, Any] = {}

    def walk(node: Any, leaf: Any) -> None:
        tag = node.get("t") if isinstance(node, dict) else None
        if tag == "tensor" and isinstance(leaf, torch.Tensor) and node.get("k") not in out:
            if "dtype" not in node:
                out[node["k"]] = leaf
            elif str(leaf.dtype).removeprefix("torch.") == node["dtype"] \
                    and list(leaf.shape) == node["shape"] and leaf.is_contiguous():
                out[node["k"]] = leaf.detach().reshape(-1).view(torch.uint8)
        elif tag == "dict" and isinstance(leaf, Mapping):
            for key, child in node["items"]:
                if key in leaf:
                    walk(child, leaf[key])
        elif tag in ("list", "tuple") and isinstance(leaf, (list, tuple)):
            for child, sub in zip(node["items"], leaf):
                walk(child, sub)

    if into is not None:
        walk(spec.get("root"), into)
    return out


def _parse_meta(path: Path, raw: bytes, h: _Header) -> dict:
    """The meta JSON of a slot whose checksum matched; CheckpointCorrupt if it is not ours."""
    try:
        meta = json.loads(raw)
        if (meta["format"], meta["version"], meta["step"], meta["seq"]) != \
                (META_FORMAT, VERSION, h.step, h.seq) or type(meta["spec"]) is not dict \
                or type(meta["meta"]) is not dict:
            raise ValueError("format, version, step or seq disagree with the header")
        for name, e in meta["tensors"].items():
            dtype = getattr(torch, e["dtype"], None)
            if not isinstance(dtype, torch.dtype) or not (
                    h.data_off <= e["offset"] <= e["offset"] + e["nbytes"] <= h.meta_off
                    and min(e["shape"], default=0) >= 0
                    and e["nbytes"] == math.prod(e["shape"]) * dtype.itemsize):
                raise ValueError(f"bad index entry for tensor {name!r}: {e}")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointCorrupt(f"{path}: malformed snapshot meta ({exc})") from exc
    return meta


def _read_header(path: Path) -> _Header | None:
    try:
        with open(path, "rb") as f:
            return _Header.unpack(f.read(_HEADER.size))
    except OSError:
        return None


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"
