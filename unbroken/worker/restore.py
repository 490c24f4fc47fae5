"""Restore at a job (re)start: every rank agrees on one step, then loads it.

Runs in the training thread of each rank, inside :meth:`unbroken.worker.session.Job.steps`,
once per process (a replacement process of an in-flight recovery does not come here: it
receives its state from replicas, see :mod:`unbroken.worker.inflight`).

Sources of a rank, by the resume rule (README "Resuming: --load and --save"): a new launch
(attempt 0) resumes only from `--load DIR`; a job-level restart inside the run (attempt > 0)
from the run's own checkpoints first, its node's shared-memory snapshots (the memory tier,
under `unbroken run`) and the steps this run committed in `--save DIR`, then from --load's.
A step is restorable only when every rank's part of it is committed in some source
(DESIGN.md section 8). Who decides:

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
from typing import TYPE_CHECKING

from unbroken.checkpoint.memory_reader import SnapshotReader
from unbroken.checkpoint.storage import StorageTier
from unbroken.errors import CheckpointError, FatalError, JobFailed, NoCheckpoint

if TYPE_CHECKING:
    from unbroken.worker.session import Job

log = logging.getLogger(__name__)


def restore(job: Job) -> int:
    """Agree on the step to resume from, load it into the tracked state; return the step
    (0 when there is nothing to restore)."""
    own_run = job.attempt > 0  # a restart inside this run: its own checkpoints count
    memory = SnapshotReader(job.cfg.checkpoint.shm_dir, job.cfg.job_id, job.rank) \
        if own_run and job._control is not None and job.cfg.job_id else None
    stores = _stores(job, own_run)
    if memory is None and not stores:
        return 0
    started = time.monotonic()
    bound: int | None = None  # the newest step this rank may still offer
    round_ = 0
    while True:
        agreed = _agree(job, memory, stores, round_, bound)
        if agreed < 0:
            if round_ and memory is not None:  # a failed load may have written into the tensors: no fresh start
                raise FatalError(f"rank {job.rank}: no checkpoint step could be loaded by every rank (the "
                                 "newest ones failed their checksums) and the tracked state may hold part of "
                                 "one; not starting from scratch. See `unbroken ckpt verify` and events.jsonl")
            return 0
        loaded = _load_step(job, memory, stores, agreed)
        if job._all_min(1 if loaded else 0):
            break
        bound = agreed if loaded else agreed - 1  # someone could not load it: go older
        round_ += 1
    state, tier, where = loaded
    job._load_state(state)
    seconds = time.monotonic() - started
    log.info("rank %d: restored step %d from %s (%s) in %.3f s", job.rank, agreed, tier, where, seconds)
    job._event("restored", step=agreed, tier=tier, dir=where, seconds=seconds)
    return agreed


def _stores(job: Job, own_run: bool) -> list[tuple[StorageTier, bool]]:
    """(storage tier, only this run's steps) in the order restore prefers them."""
    own = [(job._storage, True)] if own_run and job._storage is not None else []
    return own + ([(job._load_storage, False)] if job._load_storage is not None else [])


def _steps_in(tier: StorageTier, own_only: bool, steps: list[int]) -> list[int]:
    return tier.own_steps(steps) if own_only else steps


def _agree(job: Job, memory: SnapshotReader | None, stores: list[tuple[StorageTier, bool]], round_: int,
           bound: int | None) -> int:
    """The step every rank loads in round ``round_`` (-1: none, start fresh)."""
    if job._control is None:
        return job._all_min(_newest_available(job, memory, stores, bound))
    memory_steps = sorted({s for s, _ in memory.committed() if bound is None or s <= bound}, reverse=True) \
        if memory is not None else []
    # Listed by metadata only (cheap); a file that rotted in place fails its checksum at
    # load, and the next round goes older.
    storage_steps = sorted({s for tier, own in stores
                            for s in _steps_in(tier, own, tier.loadable_steps(job.rank, at_or_below=bound))},
                           reverse=True)
    timeout_s = job.cfg.recovery_timeout_s
    step = job._control.restore_at(round_, memory_steps, storage_steps, timeout_s)
    if step is None:
        raise JobFailed(f"rank {job.rank}: no restore decision from the controller within {timeout_s:.0f} s "
                        f"(attempt {job.attempt}, round {round_}; offered memory steps {memory_steps}, storage "
                        f"steps {storage_steps}); the controller is gone or another rank never offered. "
                        "The setting is --recovery-timeout-s; the controller's events.jsonl says more")
    return step


def _newest_available(job: Job, memory: SnapshotReader | None, stores: list[tuple[StorageTier, bool]],
                      bound: int | None) -> int:
    steps = [s for s, _ in memory.committed()] if memory is not None else []
    for tier, own in stores:  # newest first; the tensor files' checksums are verified here
        stored = next((s for s in _steps_in(tier, own, tier.loadable_steps(job.rank, at_or_below=bound))
                       if _verifies(tier, s, job.rank)), None)
        steps += [stored] if stored is not None else []
    return max((s for s in steps if bound is None or s <= bound), default=-1)


def _verifies(tier: StorageTier, step: int, rank: int) -> bool:
    try:
        tier.verify_rank(step, rank)
        return True
    except CheckpointError as exc:
        log.warning("skipping checkpoint step %d for rank %d: %s", step, rank, exc)
        return False


def _load_step(job: Job, memory: SnapshotReader | None, stores: list[tuple[StorageTier, bool]],
               step: int) -> tuple[dict, str, str] | None:
    """(state, tier, directory) of ``step`` for this rank, memory first, else the stores in
    order; None if none loads it."""
    if memory is not None:
        try:
            # Straight into the tensors of the freshly built model and optimizer: no new
            # allocation (page faults). If it fails, another step is loaded over them.
            return memory.load(step, into=job._state())[0], "memory", str(memory.dir)
        except (NoCheckpoint, CheckpointError) as exc:
            if not isinstance(exc, NoCheckpoint):
                log.warning("rank %d: shared-memory snapshot of step %d unusable: %s", job.rank, step, exc)
    for tier, own in stores:
        if own and not tier.own_steps([step]):
            continue
        try:
            return tier.load_rank(step, job.rank)[0], "storage", str(tier.root)
        except CheckpointError as exc:
            log.warning("rank %d: checkpoint of step %d in %s unusable: %s", job.rank, step, tier.root, exc)
    return None
