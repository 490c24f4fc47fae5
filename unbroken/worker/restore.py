"""Restore at a job (re)start: every rank agrees on one step, then loads it.

Runs in the training thread of each rank, inside :meth:`unbroken.worker.session.Job.steps`,
once per process (a replacement process of an in-flight recovery does not come here: it
receives its state from replicas, see :mod:`unbroken.worker.inflight`). It sees only narrow
collaborators: :class:`RestoreSources` (tiers, controller link, all-reduce) and the tracked state.

Sources of a rank, fastest first: its own node's shared-memory snapshots (the memory
tier, under `unbroken run`), then the storage tier. A step is restorable only when every
rank's part of it is committed in some tier (DESIGN.md section 8). Who decides:

* under `unbroken run` the controller: each rank offers the steps it can load
  (:class:`~unbroken.protocol.messages.RestoreOffer`), the controller picks the newest
  step every rank offered (:func:`unbroken.recovery.restore_point.decide_restore`), logs
  it (``restore_decided``) and answers every rank (``RestoreAt``);
* under plain torchrun or python (no controller) the ranks themselves: an all-reduce MIN
  of each rank's newest loadable step.

Then every rank loads the step (memory first, else storage) and an all-reduce MIN of
"loaded" confirms it everywhere. If some rank could not load it (a file that rotted in
place), the ranks agree again, in the next round, on an older step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from unbroken.checkpoint.memory_reader import SnapshotReader
from unbroken.checkpoint.storage import StorageTier
from unbroken.errors import CheckpointError, FatalError, JobFailed, NoCheckpoint
from unbroken.worker.control import ControlClient
from unbroken.worker.tracked import TrackedState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestoreSources:
    """What one rank restores from and with whom it agrees (the session builds it)."""

    rank: int
    attempt: int
    recovery_timeout_s: float
    memory: SnapshotReader | None  # this node's shared-memory snapshots (under `unbroken run`)
    storage: StorageTier | None
    control: ControlClient | None  # the controller decides the step; None: the ranks agree by all_min
    all_min: Callable[[int], int]  # an all-reduce MIN over every rank


def restore(src: RestoreSources, tracked: TrackedState, event: Callable[..., None]) -> int:
    """Agree on the step to resume from, load it into the tracked state; return the step
    (0 when there is nothing to restore)."""
    if src.memory is None and src.storage is None:
        return 0
    started = time.monotonic()
    bound: int | None = None  # the newest step this rank may still offer
    round_ = 0
    while True:
        agreed = _agree(src, round_, bound)
        if agreed < 0:
            if round_ and src.memory is not None:  # a failed load may have written into the tensors: no fresh start
                raise FatalError(f"rank {src.rank}: no checkpoint step could be loaded by every rank (the "
                                 "newest ones failed their checksums) and the tracked state may hold part of "
                                 "one; not starting from scratch. See `unbroken ckpt verify` and events.jsonl")
            return 0
        loaded = _load_step(src, tracked, agreed)
        if src.all_min(1 if loaded else 0):
            break
        bound = agreed if loaded else agreed - 1  # someone could not load it: go older
        round_ += 1
    state, tier = loaded
    tracked.load_tree(state)
    seconds = time.monotonic() - started
    log.info("rank %d: restored step %d from %s in %.3f s", src.rank, agreed, tier, seconds)
    event("restored", step=agreed, tier=tier, seconds=seconds)
    return agreed


def _agree(src: RestoreSources, round_: int, bound: int | None) -> int:
    """The step every rank loads in round ``round_`` (-1: none, start fresh)."""
    if src.control is None:
        return src.all_min(_newest_available(src, bound))
    memory_steps = sorted({s for s, _ in src.memory.committed() if bound is None or s <= bound}, reverse=True) \
        if src.memory is not None else []
    # Listed by metadata only (cheap); a file that rotted in place fails its checksum at
    # load, and the next round goes older.
    storage_steps = src.storage.loadable_steps(src.rank, at_or_below=bound) if src.storage is not None else []
    timeout_s = src.recovery_timeout_s
    step = src.control.restore_at(round_, memory_steps, storage_steps, timeout_s)
    if step is None:
        raise JobFailed(f"rank {src.rank}: no restore decision from the controller within {timeout_s:.0f} s "
                        f"(attempt {src.attempt}, round {round_}; offered memory steps {memory_steps}, storage "
                        f"steps {storage_steps}); the controller is gone or another rank never offered. "
                        "The setting is --recovery-timeout-s; the controller's events.jsonl says more")
    return step


def _newest_available(src: RestoreSources, bound: int | None) -> int:
    steps = [s for s, _ in src.memory.committed()] if src.memory is not None else []
    stored = src.storage.newest_loadable_step(src.rank, at_or_below=bound) if src.storage else None
    candidates = [s for s in steps if bound is None or s <= bound] + ([stored] if stored is not None else [])
    return max(candidates, default=-1)


def _load_step(src: RestoreSources, tracked: TrackedState, step: int) -> tuple[dict, str] | None:
    """(state, tier) of ``step`` for this rank, memory first, else storage; None if neither loads it."""
    if src.memory is not None:
        try:
            # Straight into the tensors of the freshly built model and optimizer: no new
            # allocation (page faults). If it fails, another step is loaded over them.
            return src.memory.load(step, into=tracked.tree())[0], "memory"
        except (NoCheckpoint, CheckpointError) as exc:
            if not isinstance(exc, NoCheckpoint):
                log.warning("rank %d: shared-memory snapshot of step %d unusable: %s", src.rank, step, exc)
    if src.storage is not None:
        try:
            return src.storage.load_rank(step, src.rank)[0], "storage"
        except CheckpointError as exc:
            log.warning("rank %d: checkpoint of step %d unusable: %s", src.rank, step, exc)
    return None
