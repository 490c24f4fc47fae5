"""Point-to-point state transfer: each piece from one live holder to each rank that needs it.

In-flight recovery hands a replacement its state piece by piece; a *move* ``(key, src, dst)``
(planned by :mod:`unbroken.recovery.transfer_plan`, the same on every rank) is a private
conversation of two ranks over the generation's process group. A rank issues only the ops
of its own moves: a survivor in no move sends and receives nothing. The moves of one pair of
ranks travel together as one *bundle*, in few messages, so the cost is a few round trips per
holder, not one message per tensor:

1. a header: two int64, the meta's bytes and the flat buffer's bytes;
2. the meta (UTF-8 JSON: per piece its key, :mod:`unbroken.state.tree` spec and tensor index
   ``[name, dtype, shape]``, dtypes by their :mod:`unbroken.state.dtypes` names) and one flat
   byte buffer holding every tensor of at most ``BATCH_MAX_BYTES`` (64-byte aligned, in index
   order), both received at once;
3. one message per larger tensor, received straight into the receiver's own tensor of that
   name where device, dtype and shape match (its existing state: a replacement's freshly built
   model), or into a new one.

Small tensors are copied out of the flat buffer into the receiver's own tensors (or new ones)
by the training thread once everything arrived. Nothing is unpickled: the meta is JSON,
tensors are raw bytes. Bundles from different holders run in parallel.

:func:`send_recv_tensors` is the bare form for tensors whose layout both sides know (a
parameter range of a flat buffer). Runs in the training thread of each rank. gloo's send and
recv works complete only inside ``wait()`` (``is_completed()`` stays False until then:
checked here), so one daemon thread per call runs the blocking part (the receive rounds, then
the waits on the sends) while the training thread waits for it with the abort check
(:class:`_InThread`: blocked until it ends or the abort wakes it, with an ``AbortWatch``).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from unbroken.comm.wait import wait_all
from unbroken.errors import CheckpointCorrupt, CollectiveAborted
from unbroken.state.dtypes import PLAIN_DTYPES, dtype_name, dtype_named
from unbroken.state.tree import flatten_state, unflatten_state

Move = tuple[str, int, int]  # (key, src, dst): group ranks; unbroken.recovery.transfer_plan.Move is one
_TAG_STRIDE = 1 << 20  # message k of bundle i has tag i * _TAG_STRIDE + k: up to ~1M large tensors a bundle
BATCH_MAX_BYTES = 1 << 20  # tensors up to this size travel in the bundle's one flat buffer
_ALIGN_BYTES = 64  # every tensor's offset in the flat buffer (any dtype's alignment)
_HEADER, _META, _FLAT, _FIRST_LARGE = 0, 1, 2, 3  # message numbers within a bundle


@dataclass
class _Bundle:
    """The moves of one (src, dst) pair; ``tag``: the base tag of its messages (same on both sides)."""

    tag: int
    src: int
    dst: int
    keys: list[str] = field(default_factory=list)


def _bundles(moves: Sequence[Move], rank: int) -> list[_Bundle]:
    """The bundles ``rank`` takes part in; tags numbered over all bundles of the plan, in the
    order their first move appears, so every rank numbers them alike."""
    by_pair: dict[tuple[int, int], _Bundle] = {}
    for key, src, dst in moves:
        bundle = by_pair.setdefault((src, dst), _Bundle(len(by_pair) * _TAG_STRIDE, src, dst))
        bundle.keys.append(key)
    return [b for b in by_pair.values() if rank in (b.src, b.dst)]


def _flat_offsets(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Offset of each small tensor in the flat buffer, and its total bytes."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // _ALIGN_BYTES) * _ALIGN_BYTES
    return offsets, end


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class _InThread:
    """The blocking part of one exchange, run by a daemon thread; looks like one work to
    ``wait_all``. ``body`` runs there (it may check ``should_abort`` between its rounds). On an
    abort it goes to the graveyard; its thread ends when its works do (at the latest at the
    process-group timeout), keeping them referenced until then (FACTS.md)."""

    def __init__(self, body: Callable[[], Any]) -> None:
        self._body, self._error, self.result = body, None, None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        threading.Thread(target=self._run, daemon=True, name="unbroken-p2p-wait").start()

    def _run(self) -> None:
        try:
            self.result = self._body()
        except Exception as exc:  # noqa: BLE001 - re-raised in the training thread by wait()
            self._error = exc
        finally:
            with self._lock:
                self._done.set()
                callbacks, self._callbacks = self._callbacks, []
            for fn in callbacks:
                fn()

    def on_done(self, fn: Callable[[], None]) -> None:
        """``fn()`` once the body ended (at once if it has): lets ``wait_all`` block (comm/wait.py)."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self) -> bool:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return True


def _wait_works(works: list) -> None:
    for work in works:
        work.wait()


def exchange_states(moves: Sequence[Move], group: dist.ProcessGroup, *, state_of: Callable[[str], Any],
                    local_of: Callable[[str], Any], device: torch.device, should_abort: Callable[[], bool],
                    graveyard: list, what: str, timings: dict[str, float] | None = None) -> dict[str, Any]:
    """Carry out this rank's part of ``moves``; return ``{key: tree}`` of the pieces it received.

    ``state_of(key)``: this rank's tree of a piece it sends. ``local_of(key)``: its own
    current tree of a piece it receives (or None): tensors land in it where they fit.
    ``timings`` (optional) gets the seconds of each sub-phase (``pack_s``, ``post_s``, ``headers_s``,
    ``bodies_s``, ``large_s``, ``sends_s``, ``unpack_s``).
    """
    rank = group.rank()
    bundles = _bundles(moves, rank)
    if not bundles:
        return {}
    laps = timings if timings is not None else {}
    t0 = time.monotonic()
    outgoing = []  # (bundle, its messages): packed here, posted by the exchange's thread
    for b in bundles:
        if b.src == rank:
            outgoing.append((b, _pack_bundle(b, state_of, device)))
    incoming = [_Incoming(b, {k: local_of(k) for k in b.keys}) for b in bundles if b.dst == rank]
    laps["pack_s"] = time.monotonic() - t0

    def body() -> None:
        # Posted here, not in the training thread: a send is where a lazily connected pair
        # (--lazy-connect) connects (a store get of the peer's address, then TCP, retried), and a
        # peer lost meanwhile would hold that call until the group's timeout, past any abort order.
        t = time.monotonic()
        sends = [group.send([msg], b.dst, b.tag + k) for b, msgs in outgoing for k, msg in enumerate(msgs) if msg.numel()]
        laps["post_s"] = time.monotonic() - t
        _receive(incoming, group, device, should_abort, laps)
        t = time.monotonic()
        _wait_works(sends)  # the messages stay referenced (``outgoing``) until their sends complete
        laps["sends_s"] = time.monotonic() - t

    wait_all([_InThread(body)], should_abort, graveyard, what)
    t = time.monotonic()
    got = {key: tree for bundle in incoming for key, tree in bundle.unpack().items()}
    laps["unpack_s"] = time.monotonic() - t
    return got


def send_recv_tensors(ops: Sequence[tuple[int, int, torch.Tensor]], group: dist.ProcessGroup, *,
                      should_abort: Callable[[], bool], graveyard: list, what: str) -> None:
    """Each ``(src, dst, tensor)``: ``src`` sends its tensor into ``dst``'s (same shape on both; both
    list the same ops in the same order). A rank in no op issues nothing."""
    rank = group.rank()
    mine = [(i, src, dst, tensor) for i, (src, dst, tensor) in enumerate(ops) if rank in (src, dst)]

    def body() -> None:  # posted in the thread: a lazily connected pair connects there (exchange_states)
        _wait_works([group.send([tensor], dst, i) if src == rank else group.recv([tensor], src, i)
                     for i, src, dst, tensor in mine])
    if mine:
        wait_all([_InThread(body)], should_abort, graveyard, what)


def _pack_bundle(b: _Bundle, state_of: Callable[[str], Any], device: torch.device) -> list[torch.Tensor]:
    """The sender's side of one bundle: its messages, in message order, all posted at once (see the
    module docstring)."""
    pieces, small, large = [], [], []
    for key in b.keys:
        tensors, spec = flatten_state(state_of(key))
        pieces.append({"key": key, "spec": spec,
                       "index": [[name, dtype_name(t.dtype), list(t.shape)] for name, t in tensors.items()]})
        for t in tensors.values():
            (small if t.numel() * t.element_size() <= BATCH_MAX_BYTES else large).append(t)
    offsets, total = _flat_offsets([t.numel() * t.element_size() for t in small])
    flat = torch.empty(total, dtype=torch.uint8)
    for t, offset in zip(small, offsets):
        flat[offset:offset + t.numel() * t.element_size()].copy_(_as_bytes(t.contiguous()))
    meta = torch.frombuffer(bytearray(json.dumps({"pieces": pieces}).encode()), dtype=torch.uint8)
    header = torch.tensor([meta.numel(), total], dtype=torch.int64)
    return [header.to(device), meta.to(device), flat.to(device)] + [t.to(device).contiguous() for t in large]


class _Incoming:
    """The receiving side of one bundle: its buffers, then where each tensor lands. Filled by the
    exchange's thread (:func:`_receive`), unpacked by the training thread (:meth:`unpack`)."""

    def __init__(self, bundle: _Bundle, local: dict[str, Any]) -> None:
        self.bundle = bundle
        self.own = {k: flatten_state(tree)[0] if tree is not None else {} for k, tree in local.items()}
        self.header = torch.zeros(2, dtype=torch.int64)
        self.meta = self.flat = torch.empty(0, dtype=torch.uint8)
        self.pieces: list[tuple[str, dict, dict[str, torch.Tensor]]] = []  # (key, spec, targets)
        self.small: list[tuple[torch.Tensor, int]] = []  # (target, offset in flat)
        self.large: list[torch.Tensor] = []  # targets received directly, in message order

    def plan(self, device: torch.device) -> None:
        """Decode the meta; choose every tensor's target (CheckpointCorrupt on a bad meta)."""
        b = self.bundle
        where = f"transfer of {', '.join(b.keys)} from rank {b.src}"
        pieces = _decode_meta(self.meta, where)
        if [p["key"] for p in pieces] != b.keys:
            raise CheckpointCorrupt(f"{where}: it carries pieces {[p['key'] for p in pieces]}, expected {b.keys}")
        small_sizes = []
        for piece in pieces:
            targets = _targets(piece["index"], self.own.get(piece["key"], {}), device)
            self.pieces.append((piece["key"], piece["spec"], targets))
            for t in targets.values():
                n = t.numel() * t.element_size()
                if n <= BATCH_MAX_BYTES:
                    self.small.append((t, 0))
                    small_sizes.append(n)
                else:
                    self.large.append(t)
        offsets, total = _flat_offsets(small_sizes)
        if total != int(self.header[1]):
            raise CheckpointCorrupt(f"{where}: its flat buffer has {int(self.header[1])} bytes, its index "
                                    f"needs {total}")
        self.small = [(t, offset) for (t, _), offset in zip(self.small, offsets)]

    def unpack(self) -> dict[str, Any]:
        for t, offset in self.small:
            n = t.numel() * t.element_size()
            if n:
                _as_bytes(t).copy_(self.flat[offset:offset + n])
        return {key: unflatten_state(targets, spec) for key, spec, targets in self.pieces}


def _receive(incoming: list[_Incoming], group: dist.ProcessGroup, device: torch.device,
             should_abort: Callable[[], bool], laps: dict[str, float]) -> None:
    """In the exchange's thread: every incoming bundle at once, in (at most) three rounds: headers,
    meta + flat buffers, large tensors. Stops between rounds on an abort order (CollectiveAborted)."""
    if not incoming:
        return
    t = time.monotonic()
    for bundle in incoming:
        bundle.header = bundle.header.to(device)
    _wait_works([group.recv([b.header], b.bundle.src, b.bundle.tag + _HEADER) for b in incoming])
    laps["headers_s"] = time.monotonic() - t
    _stop_on_abort(should_abort)
    t, works = time.monotonic(), []
    for b in incoming:
        b.meta = torch.empty(int(b.header[0]), dtype=torch.uint8, device=device)
        b.flat = torch.empty(int(b.header[1]), dtype=torch.uint8, device=device)
        works += [group.recv([buf], b.bundle.src, b.bundle.tag + k)
                  for k, buf in ((_META, b.meta), (_FLAT, b.flat)) if buf.numel()]
    _wait_works(works)
    laps["bodies_s"] = time.monotonic() - t
    _stop_on_abort(should_abort)
    t, works = time.monotonic(), []
    for b in incoming:
        b.plan(device)
        works += [group.recv([target], b.bundle.src, b.bundle.tag + _FIRST_LARGE + k)
                  for k, target in enumerate(b.large) if target.numel()]
    _wait_works(works)
    laps["large_s"] = time.monotonic() - t


def _stop_on_abort(should_abort: Callable[[], bool]) -> None:
    """Between receive rounds: an abort order ends the exchange (raised, never a quiet return:
    the training thread must not take a half-received transfer for a complete one)."""
    if should_abort():
        raise CollectiveAborted("state transfer stopped between its receive rounds on the abort order")


def _decode_meta(buf: torch.Tensor, where: str) -> list[dict]:
    try:
        pieces = json.loads(bytes(buf.cpu().numpy()).decode())["pieces"]
        ok = isinstance(pieces, list) and all(
            isinstance(p, dict) and isinstance(p.get("key"), str) and isinstance(p.get("spec"), dict)
            and isinstance(p.get("index"), list) and all(_index_entry_ok(e) for e in p["index"]) for p in pieces)
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointCorrupt(f"{where}: its index is not valid JSON of the expected shape ({exc})") from exc
    if not ok:
        raise CheckpointCorrupt(f"{where}: its index does not list each piece's key, spec and tensors as "
                                f"[name, dtype, shape] with dtypes among {sorted(map(dtype_name, PLAIN_DTYPES))}")
    return pieces


def _index_entry_ok(e: Any) -> bool:
    return (isinstance(e, list) and len(e) == 3 and isinstance(e[0], str) and dtype_named(e[1]) in PLAIN_DTYPES
            and isinstance(e[2], list) and all(isinstance(n, int) and n >= 0 for n in e[2]))


def _targets(index: list, own: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Where each incoming tensor lands: the receiver's own tensor of that name if it fits, else a new one."""
    out = {}
    for name, named, shape in index:
        dtype = dtype_named(named)
        t = own.get(name)
        fits = (t is not None and t.device == device and t.dtype == dtype and list(t.shape) == shape
                and t.is_contiguous())
        out[name] = t if fits else torch.empty(shape, dtype=dtype, device=device)
    return out
