"""Reading the memory tier: SnapshotReader and its verified load of a slot.

Runs in the agent (the persister copies snapshots to storage) and in a restarted worker
(restore). The slot format, its constants and the writer are in
unbroken.checkpoint.memory. A read pins the newest committed slot (flock LOCK_SH), checks its
checksum table and meta, then reads the tensor bytes with pread straight into their
destinations (the caller's tensors where they fit, else new ones), CHUNK_BYTES chunks in
parallel threads, each PIECE_BYTES piece hashed right after it lands; nothing is returned
unless every chunk matches its checksum.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import logging
import math
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import xxhash

from unbroken.checkpoint.memory import (HASH, HEADER, HEADER_BYTES, META_FORMAT, VERSION, SlotState, SlotHeader,
                                        hashed_ranges, read_header)
from unbroken.checkpoint.shm_files import check_dir, open_ours, peer_slot_path, slot_path
from unbroken.errors import CheckpointCorrupt, NoCheckpoint
from unbroken.state.dtypes import dtype_name, dtype_named
from unbroken.state.tree import unflatten_state

logger = logging.getLogger(__name__)

PIECE_BYTES = 512 << 10  # a load reads this much, then hashes it while it is still in cache
_PIN_TRIES, _PIN_RETRY_S = 1000, 0.001  # a slot the writer takes meanwhile: look again, ~1 s at most
_EMPTY_SCANS = 3  # scans that find nothing committed before "nothing is"


class SnapshotReader:
    """Reads one rank's committed snapshots; runs in the agent or in a restarted worker.

    Holds nothing between calls: each read pins the newest committed slot (flock LOCK_SH;
    the writer never rewrites a pinned slot), reads its tensors with pread (no mapping, no
    page faults on the slot) straight into their destinations, hashing each piece right after
    it lands, and unpins. Safe while the writer runs: the writer only locks a slot it
    rewrites, and such a slot is never the newest committed one.
    """

    def __init__(self, shm_dir: str | os.PathLike | None, job_id: str, rank: int, *, peer: bool = False) -> None:
        """``peer``: read the copy of another node's rank this node keeps (unbroken.checkpoint.peer_copy)."""
        self.dir, self.job_id, self.rank = check_dir(shm_dir), job_id, rank
        where = peer_slot_path if peer else slot_path
        self.paths = [where(self.dir, job_id, rank, s) for s in (0, 1)]
        self.last_seq: int | None = None  # the seq of the snapshot the last successful read returned

    def slots(self) -> list[dict]:
        """Per slot: slot, path, bytes, state (SlotState name, MISSING or INVALID), step, seq."""
        out = []
        for slot, path in enumerate(self.paths):
            size, h = (os.lstat(path).st_size if os.path.lexists(path) else None), read_header(path)
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
        new tensors, and `into`'s other leaves are ignored. A leaf on a device (a GPU) of the
        same dtype and shape is filled from the verified host copy (one copy to the device) and
        returned in its place. On CheckpointCorrupt (and whenever
        a newer snapshot was skipped) tensors of `into` may be partly overwritten: load
        another step into them, or trust only the returned tree. Otherwise as read_flat.
        """
        tensors, spec, meta = self._read(step, lambda spec: _into_targets(spec, into))
        return _onto_devices(unflatten_state(tensors, spec), into), meta

    def _read(self, step: int | None, targets: Callable[[dict], dict[str, torch.Tensor]]
              ) -> tuple[dict[str, torch.Tensor], dict, dict]:
        skip: set[int] = set()
        errors: list[CheckpointCorrupt] = []
        while (pin := self._pin(step, skip)) is not None:
            slot, fd, header = pin
            try:
                out = _read_slot(self.paths[slot], fd, header, targets)
                self.last_seq = header.seq
                return out
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

    def _committed_headers(self) -> list[tuple[int, SlotHeader]]:
        found = [(slot, h) for slot, p in enumerate(self.paths)
                 if (h := read_header(p)) is not None and h.state == SlotState.COMMITTED]
        return sorted(found, key=lambda item: item[1].seq, reverse=True)

    def _pin(self, step: int | None, skip: set[int]) -> tuple[int, int, SlotHeader] | None:
        """Pin the newest committed slot (of `step`) not in `skip`: (slot, fd holding the pin,
        header), or None. Only the chosen slot is pinned (a pin on the older slot makes the
        writer rewrite the newest one meanwhile); its header is read again once pinned, so the
        header returned stays true while the pin is held."""
        empty_scans = 0
        for _ in range(_PIN_TRIES):
            found = [(h.seq, slot) for slot, path in enumerate(self.paths) if slot not in skip
                     and (h := read_header(path)) is not None and h.state == SlotState.COMMITTED
                     and step in (None, h.step)]
            if not found:
                # The two headers are read one after the other: a scan can straddle the
                # moment one slot commits and the writer takes the other. Look again.
                empty_scans += 1
                if empty_scans == _EMPTY_SCANS:
                    return None
                time.sleep(_PIN_RETRY_S)
                continue
            seq, slot = max(found)
            fd = open_ours(self.paths[slot])  # never a file planted in our name
            if fd is None:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                h = SlotHeader.unpack(os.pread(fd, HEADER.size, 0))
            except BlockingIOError:  # the writer took the slot since: look again
                h = None
            if h is not None and h.state == SlotState.COMMITTED and h.seq == seq:
                return slot, fd, h
            os.close(fd)
            time.sleep(_PIN_RETRY_S)
        return None


# ---- helpers -----------------------------------------------------------------------


def _read_slot(path: Path, fd: int, h: SlotHeader, targets: Callable[[dict], dict]
               ) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """Verify and read a pinned slot: (tensors, spec, meta). The table and the meta are
    checked first; the tensor bytes are checked as they are read into their destinations
    (`targets(spec)`, else new tensors), and nothing is returned unless all of them match."""
    end = h.table_off + HASH.size * h.n_chunks
    size = os.fstat(fd).st_size
    if size < end or not HEADER_BYTES <= h.data_off <= h.meta_off <= h.table_off \
            or h.chunk_bytes <= 0 or h.n_chunks != len(hashed_ranges(h)):
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


def _plan_reads(path: Path, index: dict, targets: dict[str, torch.Tensor], h: SlotHeader
                ) -> tuple[dict[str, torch.Tensor], list[tuple[int, int, memoryview | None]]]:
    """(tensors to return, regions): regions cover [data_off, meta_off) in order, each
    (offset, bytes, writable view of its destination, or None for alignment padding).

    A target is used when it is a plain CPU contiguous tensor of the stored dtype and shape
    that overlaps no other target (two snapshot tensors must not land in one memory)."""
    entries = sorted(index.items(), key=lambda item: item[1]["offset"])
    used = {name: t for name, e in entries if e["nbytes"]
            and _fits(t := targets.get(name), dtype_named(e["dtype"]), e["shape"])}
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
            dst = torch.empty(e["shape"], dtype=dtype_named(e["dtype"]))
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


def _read_verified(path: Path, fd: int, h: SlotHeader, regions: list, expected: tuple[int, ...]
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
            elif dtype_name(leaf.dtype) == node["dtype"] \
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


def _onto_devices(tree: Any, into: Any) -> Any:
    """`tree` with each leaf whose place in `into` holds a non-CPU tensor of the same dtype and
    shape copied into that tensor and replaced by it: a restore lands in the live device state,
    as a CPU leaf does through `_into_targets`. Runs after every byte was verified."""
    if isinstance(tree, torch.Tensor):
        if isinstance(into, torch.Tensor) and into.device.type != "cpu" and tree.device.type == "cpu" \
                and into.dtype == tree.dtype and into.shape == tree.shape:
            with torch.no_grad():
                into.copy_(tree)
            return into
        return tree
    if isinstance(tree, dict) and isinstance(into, Mapping):  # a fresh tree: changed in place
        for key in tree.keys() & into.keys():
            tree[key] = _onto_devices(tree[key], into[key])
    elif isinstance(tree, list) and isinstance(into, (list, tuple)):
        tree[:len(into)] = [_onto_devices(v, sub) for v, sub in zip(tree, into)]
    elif type(tree) is tuple and isinstance(into, (list, tuple)):
        return tuple(_onto_devices(v, sub) for v, sub in zip(tree, into)) + tree[len(into):]
    return tree


def _parse_meta(path: Path, raw: bytes, h: SlotHeader) -> dict:
    """The meta JSON of a slot whose checksum matched; CheckpointCorrupt if it is not ours."""
    try:
        meta = json.loads(raw)
        if (meta["format"], meta["version"], meta["step"], meta["seq"]) != \
                (META_FORMAT, VERSION, h.step, h.seq) or type(meta["spec"]) is not dict \
                or type(meta["meta"]) is not dict:
            raise ValueError("format, version, step or seq disagree with the header")
        for name, e in meta["tensors"].items():
            dtype = dtype_named(e["dtype"])
            if dtype is None or not (
                    h.data_off <= e["offset"] <= e["offset"] + e["nbytes"] <= h.meta_off
                    and min(e["shape"], default=0) >= 0
                    and e["nbytes"] == math.prod(e["shape"]) * dtype.itemsize):
                raise ValueError(f"bad index entry for tensor {name!r}: {e}")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointCorrupt(f"{path}: malformed snapshot meta ({exc})") from exc
    return meta
