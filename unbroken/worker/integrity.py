"""Checks that find damaged state in a live process, for rung `retry`.

Two checks, both run by the worker session (:mod:`unbroken.worker.session`):

* **non-finite gradients** (the seeds' "TRE"): entering ``sync``, before the reduction
  spreads them to every rank, this rank's gradients must be finite. A NaN loss makes every
  gradient NaN, so it is caught here too. The step is then redone on every rank.
* **cross-replica checksums** (silent data corruption): every K steps each rank sums the
  bits of its replicated state (modules and non-sharded optimizers: data-parallel copies,
  identical on every rank by construction), the sums are all-gathered, and a rank whose
  sums differ from the majority's holds a damaged copy; it takes the majority's copy.

A bit sum (the tensor's bytes read as int32 words, summed in int64) changes under any
single flipped bit, runs on any device and needs no copy to the host. It is a check
against hardware faults, not against an adversary.
"""

from __future__ import annotations

import logging

from collections import Counter
from typing import Any, Mapping, Sequence

import torch

from unbroken.errors import JobFailed, NonFiniteError, SilentCorruption
from unbroken.parallel import dtensor_state
from unbroken.worker.api import RecoverableState

log = logging.getLogger(__name__)


def gradients(tracked: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """(name, gradient) of every parameter of the tracked modules that has one."""
    return [(f"{name}.{pname}.grad", p.grad) for name, obj in tracked.items() if isinstance(obj, torch.nn.Module)
            for pname, p in obj.named_parameters() if p.grad is not None]


def check_finite(tracked: Mapping[str, Any], rank: int, step: int) -> None:
    """Raise :class:`NonFiniteError` naming the first non-finite gradient, if there is one. Not with
    an enabled GradScaler tracked: scaled gradients overflow by design, and its step skips them."""
    if any(isinstance(obj, torch.amp.GradScaler) and obj.is_enabled() for obj in tracked.values()):
        return
    grads = gradients(tracked)
    if not grads:
        return
    total = torch.nn.utils.get_total_norm([g for _, g in grads], error_if_nonfinite=False)
    if bool(torch.isfinite(total)):
        return
    bad = [name for name, g in grads if not bool(torch.isfinite(g).all())]
    if not bad:
        return  # every gradient is finite: only their norm's sum overflowed
    raise NonFiniteError(f"rank {rank}: non-finite gradients in step {step} ({len(bad)} tensor(s): "
                         f"{', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}); a NaN/Inf loss or an overflow")


def replicated_tensors(tracked: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """The tensors every data-parallel rank holds an identical copy of: the tracked modules'
    parameters and buffers, and the state of tracked optimizers that are not recoverable
    (sharded state is laid out across ranks: not a copy; so are FSDP2's DTensor shards, which
    only the ranks of one replica class hold: not compared yet)."""
    out: list[tuple[str, torch.Tensor]] = []
    for name, obj in tracked.items():
        if dtensor_state.has_dtensors(obj):
            continue
        if isinstance(obj, torch.nn.Module):
            out += [(f"{name}.{key}", t) for key, t in obj.state_dict(keep_vars=False).items()
                    if isinstance(t, torch.Tensor)]
        elif isinstance(obj, torch.optim.Optimizer) and not isinstance(obj, RecoverableState):
            for index, state in enumerate(obj.state.values()):
                out += [(f"{name}.state[{index}].{key}", t) for key, t in state.items() if isinstance(t, torch.Tensor)]
    return out


def bit_sum(t: torch.Tensor) -> torch.Tensor:
    """The int64 sum of the tensor's bytes read as int32 words (uint8 bytes if not a multiple of 4)."""
    flat = t.detach().contiguous().reshape(-1)
    words = flat.view(torch.int32) if flat.numel() * flat.element_size() % 4 == 0 else flat.view(torch.uint8)
    return words.sum(dtype=torch.int64)


def digests(tensors: Sequence[tuple[str, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """One bit sum per tensor, as an int64 vector on ``device`` (to be all-gathered)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.int64, device=device)
    return torch.stack([bit_sum(t).to(device) for _, t in tensors])


def odd_ranks(rows: Sequence[Sequence[int]]) -> tuple[list[int], int]:
    """Ranks whose digests differ from the majority's, and the size of the majority.

    The majority is the most common row; it must hold more than half of the ranks, else
    nobody can say which copy is right and every differing rank is returned with the count.
    """
    counts = Counter(tuple(r) for r in rows)
    majority, count = counts.most_common(1)[0]
    return [rank for rank, row in enumerate(rows) if tuple(row) != majority], count


def check_replicas(tracked: Mapping[str, Any], *, rank: int, world_size: int, step: int,
                   device: torch.device, gather: Any) -> list[int]:
    """Compare this rank's replicated state with every other rank's; return the odd ranks.

    ``gather(local) -> list of tensors`` all-gathers a vector over the job's group (abortable).
    Raises :class:`SilentCorruption` on an odd rank (its copy is replaced from the majority);
    :class:`JobFailed` on every rank when no majority agrees (no live copy can be trusted, the
    job restarts from its newest checkpoint).
    """
    tensors = replicated_tensors(tracked)
    rows = [g.tolist() for g in gather(digests(tensors, device))]
    odd, count = odd_ranks(rows)
    if not odd:
        return []
    if count * 2 <= world_size:
        raise JobFailed(f"rank {rank}: the replicated state differs across ranks after step {step} and no "
                               f"majority agrees ({count} of {world_size} at most): no copy can be trusted")
    if rank in odd:
        mine, majority = rows[rank], next(r for i, r in enumerate(rows) if i not in odd)
        bad = [name for (name, _), a, b in zip(tensors, mine, majority) if a != b]
        raise SilentCorruption(f"rank {rank}: {len(bad)} tensor(s) differ from the copies of {count} of "
                               f"{world_size} ranks after step {step} (silent data corruption): "
                               f"{', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}")
    log.warning("rank %d: cross-replica check after step %d: ranks %s hold odd copies; they are repaired "
                "from the majority", rank, step + 1, odd)
    return odd
