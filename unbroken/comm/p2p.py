"""Point-to-point state transfer: each piece from one live holder to each rank that needs it.

In-flight recovery hands a replacement its state piece by piece; a *move* ``(key, src, dst)``
(planned by :mod:`unbroken.recovery.transfer_plan`, the same on every rank) is a private
conversation of two ranks over the generation's process group. A rank issues only the ops
of its own moves: a survivor in no move sends and receives nothing. All ops are issued
asynchronously at once and waited on through :func:`~unbroken.comm.wait.wait_all`, so moves
from different sources run in parallel and a second fault aborts the transfer instead of
hanging it.

Per move, three kinds of message (distinct tags keep them apart): a header (two int64: meta
bytes, tensor count), the meta (UTF-8 JSON: the codec spec and the tensor index), then one
message per tensor, received straight into the receiver's own tensor of that name where
device, dtype and shape match (its existing state: a replacement's freshly built model), or
into a new one. Nothing is unpickled: the spec is JSON, tensors are raw bytes.

:func:`send_recv_tensors` is the bare form for tensors whose layout both sides know (a
parameter range of a flat buffer). Runs in the training thread of each rank; gloo's send and
recv works complete only inside ``wait()`` (``is_completed()`` stays False until then:
checked here), so a short-lived daemon thread per round waits on them while the training
thread polls it with the abort check (:class:`_WaitedInThread`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from unbroken.checkpoint.codec import flatten_state, unflatten_state
from unbroken.comm.transfer import DTYPES
from unbroken.comm.wait import wait_all
from unbroken.errors import CheckpointCorrupt

Move = tuple[str, int, int]  # (key, src, dst): group ranks; unbroken.recovery.transfer_plan.Move is one
_TAG_STRIDE = 1 << 20  # message k of move i has tag i * _TAG_STRIDE + k: up to ~1M tensors a piece


class _WaitedInThread:
    """Works waited on, in order, by a daemon thread; looks like one work to ``wait_all``. On an
    abort it goes to the graveyard; its thread ends when the works do (at the latest at the
    process-group timeout), keeping them referenced until then (FACTS.md)."""

    def __init__(self, works: list) -> None:
        self._works, self._error = works, None
        self._done = threading.Event()
        threading.Thread(target=self._run, daemon=True, name="unbroken-p2p-wait").start()

    def _run(self) -> None:
        try:
            for work in self._works:
                work.wait()
        except Exception as exc:  # noqa: BLE001 - re-raised in the training thread by wait()
            self._error = exc
        finally:
            self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self) -> bool:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return True


def _waitable(works: list) -> list:
    return [_WaitedInThread(works)] if works else []


def exchange_states(moves: Sequence[Move], group: dist.ProcessGroup, *, state_of: Callable[[str], Any],
                    local_of: Callable[[str], Any], device: torch.device, should_abort: Callable[[], bool],
                    graveyard: list, what: str) -> dict[str, Any]:
    """Carry out this rank's part of ``moves``; return ``{key: tree}`` of the pieces it received.

    ``state_of(key)``: this rank's tree of a piece it sends. ``local_of(key)``: its own
    current tree of a piece it receives (or None): tensors land in it where they fit.
    """
    rank = group.rank()
    mine = [(i, m) for i, m in enumerate(moves) if rank in (m[1], m[2])]
    if not mine:
        return {}
    works: list = []
    keep: list[torch.Tensor] = []  # buffers of sends in flight stay referenced until they complete
    for i, (key, src, dst) in mine:
        if src == rank:
            works += _post_sends(i, state_of(key), dst, group, device, keep)
    incoming = [(i, key, src) for i, (key, src, dst) in mine if dst == rank]
    sends = _waitable(works)
    received = _receive(incoming, group, local_of, device, should_abort, graveyard, what)
    wait_all(sends, should_abort, graveyard, what)
    return received


def send_recv_tensors(ops: Sequence[tuple[int, int, torch.Tensor]], group: dist.ProcessGroup, *,
                      should_abort: Callable[[], bool], graveyard: list, what: str) -> None:
    """Each ``(src, dst, tensor)``: ``src`` sends its tensor into ``dst``'s (same shape on both; both
    list the same ops in the same order). A rank in no op issues nothing."""
    rank, works = group.rank(), []
    for i, (src, dst, tensor) in enumerate(ops):
        if src == rank:
            works.append(group.send([tensor], dst, i))
        elif dst == rank:
            works.append(group.recv([tensor], src, i))
    wait_all(_waitable(works), should_abort, graveyard, what)


def _post_sends(i: int, tree: Any, dst: int, group: dist.ProcessGroup, device: torch.device,
                keep: list[torch.Tensor]) -> list:
    tensors, spec = flatten_state(tree)
    sent = [(name, t.to(device).contiguous()) for name, t in tensors.items()]
    index = [[name, str(t.dtype), list(t.shape)] for name, t in sent]
    meta = torch.frombuffer(bytearray(json.dumps({"spec": spec, "index": index}).encode()), dtype=torch.uint8)
    header = torch.tensor([meta.numel(), len(sent)], dtype=torch.int64)
    msgs = [header.to(device), meta.to(device)] + [t for _, t in sent]
    keep += msgs
    base = i * _TAG_STRIDE
    return [group.send([t], dst, base + k) for k, t in enumerate(msgs) if t.numel()]


def _receive(incoming: list[tuple[int, str, int]], group: dist.ProcessGroup, local_of: Callable[[str], Any],
             device: torch.device, should_abort: Callable[[], bool], graveyard: list, what: str) -> dict[str, Any]:
    """The receiving side, in three rounds over all incoming moves at once (header, meta, tensors)."""
    if not incoming:
        return {}

    def wait(works: list) -> None:
        wait_all(_waitable(works), should_abort, graveyard, what)

    headers = {i: torch.zeros(2, dtype=torch.int64, device=device) for i, _, _ in incoming}
    wait([group.recv([headers[i]], src, i * _TAG_STRIDE) for i, _, src in incoming])
    metas = {i: torch.empty(int(headers[i][0]), dtype=torch.uint8, device=device) for i, _, _ in incoming}
    wait([group.recv([metas[i]], src, i * _TAG_STRIDE + 1) for i, _, src in incoming if metas[i].numel()])
    plans, works = {}, []
    for i, key, src in incoming:
        meta = _decode_meta(metas[i], int(headers[i][1]), key, src)
        targets = _targets(meta["index"], local_of(key), device)
        works += [group.recv([t], src, i * _TAG_STRIDE + 2 + k) for k, t in enumerate(targets.values()) if t.numel()]
        plans[key] = (targets, meta["spec"])
    wait(works)
    return {key: unflatten_state(targets, spec) for key, (targets, spec) in plans.items()}


def _decode_meta(buf: torch.Tensor, count: int, key: str, src: int) -> dict:
    where = f"transfer of {key} from rank {src}"
    try:
        meta = json.loads(bytes(buf.cpu().numpy()).decode())
        index = meta["index"]
        ok = isinstance(meta.get("spec"), dict) and isinstance(index, list) and len(index) == count and all(
            isinstance(e, list) and len(e) == 3 and isinstance(e[0], str) and e[1] in DTYPES
            and isinstance(e[2], list) and all(isinstance(n, int) and n >= 0 for n in e[2]) for e in index)
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointCorrupt(f"{where}: its index is not valid JSON of the expected shape ({exc})") from exc
    if not ok:
        raise CheckpointCorrupt(f"{where}: its index does not list {count} tensors as [name, dtype, shape] "
                                f"with dtypes among {sorted(DTYPES)}")
    return meta


def _targets(index: list, local: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """Where each incoming tensor lands: the receiver's own tensor of that name if it fits, else a new one."""
    own = flatten_state(local)[0] if local is not None else {}
    out = {}
    for name, dtype, shape in index:
        t = own.get(name)
        fits = (t is not None and t.device == device and t.dtype == DTYPES[dtype] and list(t.shape) == shape
                and t.is_contiguous())
        out[name] = t if fits else torch.empty(shape, dtype=DTYPES[dtype], device=device)
    return out
