"""The step-start capture: what a dropped step puts back, and the per-rank part that travels.

At the start of every step under `unbroken run` the session captures every tracked object
that may change inside a step and is not covered by the commit rule (everything but modules,
torch optimizers and :class:`~unbroken.worker.api.RecoverableState` objects: schedulers,
samplers, loaders, tensors, user objects) and the RNG streams. When the step is dropped,
the survivor loads the capture back.

The capture is encoded once with the checkpoint codec (``flatten_state``: tensors plus a JSON
spec; never pickle), in two parts:

* ``local``: the replicated objects that roll back (kept in this process, tensors cloned);
* ``per_rank``: the RNG streams and the per-rank objects as one safetensors blob (bytes).
  It goes to the controller with the ``compute`` report (start of the step) and with the
  commit report (after compute), so a replacement for this rank receives *its own* state.

Pure functions and one small value class; lives in the training thread of one rank.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from unbroken.checkpoint.codec import flatten_state, unflatten_state
from unbroken.errors import CheckpointCorrupt, CheckpointError, ConfigError
from unbroken.protocol.messages import PER_RANK_LIMIT_BYTES

_BLOB_FORMAT = "unbroken-state-blob-1"


def encode_tree(tree: Any) -> bytes:
    """``tree`` (tensors and plain values) as one self-describing blob: an 8-byte length, a JSON
    header (the codec's spec and a table of the tensors) and the tensors' raw bytes. (Not
    safetensors: its writer costs ~10x more for the few small tensors of a per-step capture.)"""
    tensors, spec = flatten_state(tree)
    table, parts = [], []
    for name, t in tensors.items():
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        table.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), len(raw)])
        parts.append(raw)
    header = json.dumps({"format": _BLOB_FORMAT, "spec": spec, "tensors": table}).encode()
    return len(header).to_bytes(8, "little") + header + b"".join(parts)


def decode_tree(data: bytes, what: str) -> Any:
    """The tree :func:`encode_tree` made; CheckpointCorrupt naming ``what`` if it is not one."""
    try:
        tensors, spec = _read_blob(data)
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as exc:
        raise CheckpointCorrupt(f"{what}: not an encoded state ({type(exc).__name__}: {exc})") from exc
    return unflatten_state(tensors, spec)


def _read_blob(data: bytes) -> tuple[dict[str, torch.Tensor], dict]:
    if len(data) < 8:
        raise ValueError(f"{len(data)} bytes: shorter than the header length")
    header_len = int.from_bytes(data[:8], "little")
    if header_len > len(data) - 8:
        raise ValueError(f"header length {header_len} past the end ({len(data)} bytes)")
    header = json.loads(data[8:8 + header_len])
    if header.get("format") != _BLOB_FORMAT:
        raise ValueError(f"format {header.get('format')!r}, expected {_BLOB_FORMAT!r}")
    tensors, offset = {}, 8 + header_len
    for name, dtype_name, shape, nbytes in header["tensors"]:
        dtype = getattr(torch, str(dtype_name), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"tensor {name!r}: {dtype_name!r} is not a torch dtype")
        numel = 1
        for size in shape:
            numel *= int(size)
        if nbytes != numel * dtype.itemsize or offset + nbytes > len(data):
            raise ValueError(f"tensor {name!r}: {nbytes} bytes for shape {shape} of {dtype_name}, "
                             f"{len(data) - offset} left")
        flat = torch.frombuffer(bytearray(data[offset:offset + nbytes]), dtype=torch.uint8) if nbytes \
            else torch.empty(0, dtype=torch.uint8)
        tensors[name] = flat.view(dtype).reshape(shape)
        offset += nbytes
    if offset != len(data):
        raise ValueError(f"{len(data) - offset} bytes after the last tensor")
    return tensors, header["spec"]


@dataclass(frozen=True)
class StepCapture:
    """One rank's state at the start of ``step`` (see the module docstring)."""

    step: int
    local_tensors: dict[str, torch.Tensor]
    local_spec: dict
    per_rank: bytes

    def local(self) -> dict[str, Any]:
        return unflatten_state(self.local_tensors, self.local_spec)

    def per_rank_tree(self) -> dict[str, Any]:
        return decode_tree(self.per_rank, f"per-rank state of step {self.step}")


def capture(step: int, local: dict[str, Any], per_rank: dict[str, Any], *, rank: int) -> StepCapture:
    """Encode the trees of one step start; ConfigError if the per-rank part is over the limit."""
    tensors, spec = flatten_state(local)
    tensors = {name: t.clone() for name, t in tensors.items()}  # the step mutates the originals
    blob = encode_tree(per_rank)
    if len(blob) > PER_RANK_LIMIT_BYTES:
        raise ConfigError(_too_big(per_rank, len(blob), rank))
    return StepCapture(step, tensors, spec, blob)


def _too_big(per_rank: dict[str, Any], total_bytes: int, rank: int) -> str:
    sizes = {}
    for name, state in per_rank.get("objects", {}).items():
        try:
            sizes[name] = len(encode_tree(state))
        except CheckpointError:
            sizes[name] = 0
    biggest = max(sizes, key=sizes.__getitem__) if sizes else "rng"
    return (f"rank {rank}: the per-rank state is {total_bytes} bytes, over the {PER_RANK_LIMIT_BYTES}-byte "
            f"limit (it is copied to the controller every step); the biggest is {biggest!r} "
            f"({sizes.get(biggest, total_bytes)} bytes). Mark big objects replicated when every rank holds the "
            f"same: job.track(..., replicated=[{biggest!r}])")
