"""Checkpoints a worker writes: shared-memory snapshots (the memory tier) and storage saves.

Runs in the training thread of each rank, inside :meth:`unbroken.worker.session.Job.steps`
(after each completed step, and the capacity check before the first) and
:meth:`~unbroken.worker.session.Job.checkpoint`. Restoring them is :mod:`unbroken.worker.restore`.

* the **memory tier** (under `unbroken run` with a job id and ``every_steps``): every
  ``every_steps`` steps the state is copied into this rank's shared-memory slot
  (:class:`~unbroken.checkpoint.memory.SnapshotWriter`, built at the first snapshot; the
  step is blocked only for the copy), and the agent persists some of them to storage. If
  a snapshot fails (e.g. /dev/shm too small), the memory tier is off for the rest of the
  process and storage checkpoints go on;
* the **storage tier** otherwise: every ``storage_every_steps`` steps each rank writes its
  part, and rank 0 commits the step once every rank's part is durable.

A failed checkpoint never stops training: it is reported as a ``checkpoint_failed`` event
(and a warning, once), and the previous checkpoint stays the newest.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from unbroken.checkpoint.memory import SnapshotWriter
from unbroken.checkpoint.capacity import check_shm_capacity, estimate_snapshot_bytes
from unbroken.errors import CheckpointError

if TYPE_CHECKING:
    from unbroken.worker.session import Job

log = logging.getLogger(__name__)


def check_capacity(job: Job) -> None:
    """Before the first step: ShmCapacityError unless the memory-tier slots of every rank on
    this node fit in the shm dir, with the optimizers' state as after their first step."""
    ckpt = job.cfg.checkpoint
    optimizers = [o for o in job._tracked.values() if isinstance(o, torch.optim.Optimizer)]
    snapshot_bytes = estimate_snapshot_bytes(job._state(), optimizers)
    needed = check_shm_capacity(ckpt.shm_dir, job.cfg.job_id, rank=job.rank, snapshot_bytes=snapshot_bytes,
                                local_world_size=job.cfg.local_world_size)
    log.info("rank %d: memory tier fits in %s: about %d bytes per snapshot, %d bytes for the node's "
             "%d rank(s)", job.rank, ckpt.shm_dir, snapshot_bytes, needed, job.cfg.local_world_size)


def after_step(job: Job) -> None:
    """After a completed step: the checkpoint its step number calls for, if any."""
    ckpt = job.cfg.checkpoint
    if job._memory_tier:  # a shared-memory snapshot; the agent persists some of them
        if job._step % ckpt.every_steps == 0:
            snapshot(job, job._step)
    elif ckpt.storage_every_steps and job._step % ckpt.storage_every_steps == 0:
        save(job, job._step)


def checkpoint_now(job: Job) -> None:
    """Checkpoint the state after the last completed step: to memory (if on), and to storage."""
    if job._memory_tier:
        snapshot(job, job._step)
    save(job, job._step)


def snapshot(job: Job, step: int) -> None:
    """Copy the state into this rank's shared-memory slot (the step is blocked only for the copy)."""
    try:
        if job._snapshots is None:
            ckpt = job.cfg.checkpoint
            hold = ckpt.persist_every_steps if ckpt.save_dir else 0  # kept until the agent persisted it
            job._snapshots = SnapshotWriter(ckpt.shm_dir, job.cfg.job_id, job.rank, hold_every=hold)
        job._snapshots.write(step, job._state(), {"step": step})
    except CheckpointError as exc:  # e.g. /dev/shm too small: storage checkpoints go on
        job._memory_tier = False
        _save_failed(job, step, exc)


def save(job: Job, step: int) -> None:
    """Write this rank's part of ``step`` to storage; rank 0 commits it once every rank's
    part is durable (a collective: every rank calls this for the same step)."""
    if job._storage is None or job.cfg.checkpoint.save_dir is None:
        return
    started = time.monotonic()
    previous, job._phase = job._phase, "checkpoint"
    ok = 1
    try:
        job._storage.save_rank(step, job.rank, job.world_size, job._state(), {"step": step})
    except (CheckpointError, OSError) as exc:
        ok = 0
        _save_failed(job, step, exc)
    job._injector.at(step, "checkpoint")
    # The step is committed only when every rank's part is durable.
    if job._all_min(ok) and job.rank == 0:
        try:
            job._storage.commit(step, job.world_size)
        except (CheckpointError, OSError) as exc:
            _save_failed(job, step, exc)
            ok = 0
    job._phase = previous
    if ok:
        job._event("checkpoint_saved", step=step, tier="storage", seconds=time.monotonic() - started)


def close(job: Job) -> None:
    """Wait for the last snapshot's commit and unmap the slots (the files stay for the agent)."""
    if job._snapshots is not None:
        job._snapshots.close()
        job._snapshots = None


def _save_failed(job: Job, step: int, exc: Exception) -> None:
    job._event("checkpoint_failed", step=step, reason=str(exc))
    if not job._warned_save_failure:
        job._warned_save_failure = True
        log.warning("rank %d: checkpoint of step %d failed, training continues with the previous "
                    "checkpoint: %s (reported once)", job.rank, step, exc)
