"""Moving training state between live ranks over the process group, without pickle.

Used by in-flight recovery: a survivor that holds a piece of state sends it to the ranks
that lost it (a replacement process, or a survivor that must catch up). A state tree is
flattened with the checkpoint codec into tensors + a JSON spec; the source broadcasts the
spec's length, the spec (UTF-8 JSON bytes) and one byte buffer holding every tensor.
Receivers rebuild the tree. Every collective is waited on with the abort check, so a
second fault during the transfer ends it promptly instead of hanging.

Runs in the training thread of each rank.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import torch
import torch.distributed as dist

from unbroken.checkpoint.codec import flatten_state, unflatten_state
from unbroken.comm.wait import wait_all

DTYPES = {str(t): t for t in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                               torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


def _to_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def broadcast_state(tree: Any, src: int, group: dist.ProcessGroup, *, device: torch.device,
                    should_abort: Callable[[], bool], graveyard: list, what: str) -> Any:
    """Broadcast ``tree`` from group rank ``src``; every rank returns the source's tree.

    On the source, ``tree`` is its state; elsewhere it is ignored. Tensors come back on
    ``device`` (the source's own tree is returned as it is).
    """
    rank = group.rank()
    # Everything travels on the collective's device (CPU for gloo, the GPU for NCCL).
    header = torch.zeros(2, dtype=torch.int64, device=device)
    if rank == src:
        tensors, spec = flatten_state(tree)
        index = [[name, str(t.dtype), list(t.shape), t.numel() * t.element_size()] for name, t in tensors.items()]
        meta = json.dumps({"spec": spec, "index": index}).encode()
        header[0], header[1] = len(meta), sum(entry[3] for entry in index)
    _wait(dist.broadcast(header, group_src=src, group=group, async_op=True), should_abort, graveyard, what)
    meta_buf = torch.empty(int(header[0]), dtype=torch.uint8, device=device)
    data = torch.empty(int(header[1]), dtype=torch.uint8, device=device)
    if rank == src:
        meta_buf.copy_(torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(device))
        offset = 0
        for name, t in tensors.items():
            n = t.numel() * t.element_size()
            data[offset:offset + n].copy_(_to_bytes(t.to(device)))
            offset += n
    works = [dist.broadcast(meta_buf, group_src=src, group=group, async_op=True)]
    if data.numel():
        works.append(dist.broadcast(data, group_src=src, group=group, async_op=True))
    wait_all(works, should_abort, graveyard, what)
    if rank == src:
        return tree
    decoded = json.loads(bytes(meta_buf.cpu().numpy()).decode())
    out, offset = {}, 0
    for name, dtype, shape, nbytes in decoded["index"]:
        chunk = data[offset:offset + nbytes].clone()
        out[name] = chunk.view(DTYPES[dtype]).reshape(shape)
        offset += nbytes
    return unflatten_state(out, decoded["spec"])


def _wait(work, should_abort, graveyard, what) -> None:
    wait_all([work], should_abort, graveyard, what)
