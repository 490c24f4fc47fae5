"""How many bytes the memory tier needs, and whether they fit: the sizing rules in one place.

* the **slot sizes** of the slot format (:mod:`unbroken.checkpoint.memory`): header,
  checksum chunks, and the growth rule of a slot that is too small;
* the **headroom** left free in the shm dir, one rule for the writer and the check;
* the **snapshot estimate** before the first step (:func:`estimate_snapshot_bytes`), with
  the optimizer state that appears at step 1 counted from a table of torch optimizers;
* the **capacity check** a worker runs before its first step (:func:`check_shm_capacity`).

Runs in the worker (the check) and in the writer (the growth and headroom rules). Pure but
for ``os.statvfs`` of the shm dir.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import Any

import torch

from unbroken.checkpoint.shm_files import check_dir, check_job_id, job_bytes
from unbroken.errors import ShmCapacityError
from unbroken.units import format_bytes as _size, round_up

HEADER_BYTES = 4096  # tensor data starts on the second page
CHUNK_BYTES = 16 << 20  # checksum granularity: chunks verify (and copy) in parallel on load
GROWTH, GROW_ROUND_BYTES = 1.25, 2 << 20  # a slot too small grows to needed * 1.25, once
MIN_HEADROOM_BYTES = 256 << 20  # left free in shm_dir: max(this, 10% of the free bytes)


def headroom_bytes(free_bytes: int) -> int:
    """Bytes of the shm dir that snapshots leave free: max(MIN_HEADROOM_BYTES, 10% of the free)."""
    return max(free_bytes // 10, MIN_HEADROOM_BYTES)


def grown_slot_bytes(needed_bytes: int) -> int:
    """The size a slot grows to when it must hold ``needed_bytes``."""
    return round_up(math.ceil(needed_bytes * GROWTH), GROW_ROUND_BYTES)



# Parameter-sized tensors a torch.optim optimizer keeps per parameter once it has stepped
# (before its first step `optimizer.state` is empty). Adam/AdamW with amsgrad, SGD and
# RMSprop depend on their options (_state_tensors); an optimizer not listed counts as 2.
_STATE_TENSORS = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adadelta": 2,
                  "Rprop": 2, "Adagrad": 1, "ASGD": 1, "Adafactor": 1, "SGD": 1, "RMSprop": 1}
_UNKNOWN_STATE_TENSORS = 2
_TENSOR_OVERHEAD_BYTES = 512  # per tensor: its alignment and its entries in the slot's JSON meta
_LEAF_OVERHEAD_BYTES = 16  # per non-tensor value or container in the JSON meta, besides its text


def estimate_snapshot_bytes(state: Any, optimizers: Iterable[Any] = ()) -> int:
    """Bytes one memory-tier snapshot of `state` takes (tensors, their JSON meta), plus the
    state `optimizers` will create at their first step for parameters that have none yet.

    An upper estimate: tied tensors count twice, meta text is rounded up. Runs in the worker.
    """
    return _tree_bytes(state) + sum(_missing_optimizer_bytes(opt) for opt in optimizers)


def shm_slots_bytes(snapshot_bytes: int) -> int:
    """Bytes the two slots of one rank take for snapshots of `snapshot_bytes`: header and
    checksum table added, then grown as SnapshotWriter grows a slot (GROWTH, rounded up)."""
    needed = HEADER_BYTES + snapshot_bytes + 8 * (snapshot_bytes // CHUNK_BYTES + 2)  # + xxh3 table
    return 2 * grown_slot_bytes(needed)


def check_shm_capacity(shm_dir: str | os.PathLike | None, job_id: str, *, rank: int,
                       snapshot_bytes: int, local_world_size: int) -> int:
    """Return the bytes the memory tier of this node needs in `shm_dir`; ShmCapacityError if
    they do not fit with headroom left free.

    Needed: the two slots (shm_slots_bytes) of each of the node's `local_world_size` ranks,
    all assumed as large as this rank's. Headroom: SnapshotWriter's own rule,
    max(MIN_HEADROOM_BYTES, 10% of the free bytes), so a job that passes never fails the
    writer's check later. Every local rank checks before any slot is grown, so each counts
    them all; bytes this job's files already hold (a restarted job reuses them) count as free.
    """
    directory = check_dir(shm_dir)
    slots = shm_slots_bytes(snapshot_bytes)
    needed = slots * local_world_size
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize + job_bytes(directory, check_job_id(job_id))
    headroom = headroom_bytes(free)
    if needed + headroom > free:
        raise ShmCapacityError(
            f"the memory tier of job {job_id!r} does not fit in {directory}: a snapshot of rank {rank} "
            f"takes about {_size(snapshot_bytes)} (its optimizer state after the first step included), "
            f"2 slots of it per rank for {local_world_size} rank(s) on this node need {needed} bytes "
            f"({_size(needed)}), and {headroom} bytes ({_size(headroom)}: max({_size(MIN_HEADROOM_BYTES)}, "
            f"10% of the free bytes)) must stay free, but only {free} bytes ({_size(free)}) are free in "
            f"{directory}. Turn the memory tier off with `--ckpt-every-steps 0` (storage checkpoints "
            f"go on with --save), give it a larger tmpfs (`mount -o remount,size=... {directory}`, "
            "docker --shm-size, or --shm-dir DIR), or run fewer ranks per node (--nproc-per-node).")
    return needed


def _tree_bytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size() + _TENSOR_OVERHEAD_BYTES
    if isinstance(x, dict):
        return _LEAF_OVERHEAD_BYTES + sum(len(str(k)) + _LEAF_OVERHEAD_BYTES + _tree_bytes(v)
                                          for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return _LEAF_OVERHEAD_BYTES + sum(_tree_bytes(v) for v in x)
    if isinstance(x, bytes):
        return _LEAF_OVERHEAD_BYTES + len(x) * 4 // 3 + 4  # base64 in the meta
    return _LEAF_OVERHEAD_BYTES + len(repr(x))


def _missing_optimizer_bytes(opt: Any) -> int:
    """Bytes of the state `opt` creates at its first step for its parameters without state.

    An optimizer that wraps another (``ShardedOptimizer``) names it as ``wrapped``; its
    parameter groups hold this rank's shard pieces and its state is the wrapped optimizer's,
    so for it the count is exact for the shard.
    """
    name = _optimizer_name(getattr(opt, "wrapped", opt))
    total = 0
    for group in opt.param_groups:
        per_param = _state_tensors(name, group)
        for p in group["params"]:
            if not opt.state.get(p):  # state already there is counted with the state itself
                # parameter-sized tensors of its dtype, plus scalars such as Adam's `step`
                total += per_param * (p.numel() * p.element_size() + _TENSOR_OVERHEAD_BYTES) \
                    + 2 * _TENSOR_OVERHEAD_BYTES
    return total


def _optimizer_name(opt: Any) -> str:
    for cls in type(opt).__mro__:  # a subclass of a torch optimizer keeps that one's state
        if cls.__module__.startswith("torch.optim") and cls.__name__ in _STATE_TENSORS:
            return cls.__name__
    return type(opt).__qualname__


def _state_tensors(name: str, group: dict) -> int:
    if name in ("Adam", "AdamW") and group.get("amsgrad"):
        return 3  # exp_avg, exp_avg_sq, max_exp_avg_sq
    if name == "SGD":
        return 1 if group.get("momentum") else 0  # momentum_buffer
    if name == "RMSprop":
        return 1 + bool(group.get("momentum")) + bool(group.get("centered"))
    return _STATE_TENSORS.get(name, _UNKNOWN_STATE_TENSORS)
