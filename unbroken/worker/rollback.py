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

import safetensors
import safetensors.torch
import torch

from unbroken.checkpoint.codec import flatten_state, unflatten_state
from unbroken.errors import CheckpointCorrupt, CheckpointError, ConfigError
from unbroken.protocol.messages import PER_RANK_LIMIT_BYTES

_SPEC_KEY = "unbroken-spec"


def encode_tree(tree: Any) -> bytes:
    """``tree`` (tensors and plain values) as one self-describing blob (safetensors + JSON spec)."""
    tensors, spec = flatten_state(tree)
    return safetensors.torch.save(tensors, metadata={_SPEC_KEY: json.dumps(spec)})


def decode_tree(data: bytes, what: str) -> Any:
    """The tree :func:`encode_tree` made; CheckpointCorrupt naming ``what`` if it is not one."""
    try:
        tensors = safetensors.torch.load(data)
        spec = json.loads(_metadata(data)[_SPEC_KEY])
    except (safetensors.SafetensorError, ValueError, KeyError, TypeError, RuntimeError, OSError) as exc:
        raise CheckpointCorrupt(f"{what}: not an encoded state ({type(exc).__name__}: {exc})") from exc
    return unflatten_state(tensors, spec)


def _metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors blob (its JSON header)."""
    if len(data) < 8:
        raise ValueError("shorter than a safetensors header")
    header_len = int.from_bytes(data[:8], "little")
    if header_len > len(data) - 8:
        raise ValueError(f"header length {header_len} past the end ({len(data)} bytes)")
    header = json.loads(data[8:8 + header_len])
    meta = header.get("__metadata__")
    if not isinstance(meta, dict):
        raise KeyError("no metadata")
    return meta


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
