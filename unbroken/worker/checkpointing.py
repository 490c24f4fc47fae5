"""Checkpoints a worker writes: shared-memory snapshots (the memory tier) and storage saves.

A :class:`Checkpointer` runs in the training thread of each rank, called from
:meth:`unbroken.worker.session.Job.steps` (after each completed step, and the capacity check
before the first), :meth:`~unbroken.worker.session.Job.checkpoint` and rung `dump`
(:mod:`unbroken.worker.inflight`). Restoring them is :mod:`unbroken.worker.restore`.

* the **memory tier** (under `unbroken run` with a job id and ``every_steps``): every
  ``every_steps`` steps the state is copied into this rank's shared-memory slot
  (:class:`~unbroken.checkpoint.memory.SnapshotWriter`, built at the first snapshot), and the
  agent persists some of them to storage. What a step may change before its update (norm
  statistics, tracked tensors, RNG, other objects) is copied at the step boundary; parameters
  and optimizer state are copied while the next step's forward and backward run, and the
  session calls :meth:`Checkpointer.settle` where they may change next (the update, a
  recovery, the loop's end, an injected memory fault): the step waits there only for what is
  left of the copy. A step that ends without an update leaves its snapshot unsettled: it is
  abandoned (never committed) and the overlap is off for the rest of the process
  (``--no-overlap-snapshots`` turns it off from the start). If a snapshot fails (e.g.
  /dev/shm too small), the memory tier is off for the rest of the process and storage
  checkpoints go on;
* the **storage tier** otherwise: every ``storage_every_steps`` steps each rank writes its
  part, and rank 0 commits the step once every rank's part is durable.

A failed checkpoint never stops training: it is reported as a ``checkpoint_failed`` event
(and a warning, once), and the previous checkpoint stays the newest.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from unbroken.checkpoint.capacity import check_shm_capacity, estimate_snapshot_bytes
from unbroken.checkpoint.memory import SnapshotWriter
from unbroken.checkpoint.launch_dirs import run_id
from unbroken.checkpoint.storage import StorageTier
from unbroken.errors import CheckpointError, ShmCapacityError
from unbroken.faults.inject import FaultInjector
from unbroken.names import Phase
from unbroken.state.blob import decode_tree
from unbroken.worker.tracked import TrackedState
from unbroken.worker_config import WorkerConfig

log = logging.getLogger(__name__)

#: ``event(name, **fields)``: a line in the job's event log (nothing without a controller).
EventSink = Callable[..., None]


class Checkpointer:
    """One rank's checkpoint writing: owns the snapshot writer (memory tier), the storage tier
    and the warn-once state of failed saves. ``memory_tier`` goes False for good after a
    failed snapshot."""

    def __init__(self, cfg: WorkerConfig, *, managed: bool, tracked: TrackedState, injector: FaultInjector,
                 all_min: Callable[[int], int], event: EventSink, metrics: dict[str, Any]) -> None:
        self._cfg, self._tracked, self._injector = cfg, tracked, injector
        self._all_min, self._event = all_min, event
        self._metrics = metrics  # the session's progress metrics: the memory tier's size goes there
        ckpt = cfg.checkpoint
        # Where this run saves; its run id lets retention delete only this run's steps and a
        # restart resume only from them (--load's directory is restore's, see RestoreSources).
        self.storage = StorageTier(ckpt.save_dir, keep=ckpt.keep, run_id=run_id(cfg.secret, cfg.job_id)) \
            if ckpt.save_dir else None
        self.memory_tier = managed and bool(cfg.job_id) and ckpt.every_steps > 0
        self._snapshots: SnapshotWriter | None = None  # built at the first snapshot
        self.overlap = cfg.worker.overlap_snapshots  # off for good after a step without an update
        self._warned_save_failure = False

    def check_capacity(self, step: int) -> None:
        """Before the first step (``step`` steps restored): ShmCapacityError unless the memory-tier
        slots of every rank on this node fit in the shm dir, with the optimizers' state as after
        their first step.

        Only a new launch (attempt 0) fails on it, before training. A job restart mid-run degrades
        instead: the memory tier is off for this attempt (storage checkpoints go on), said once."""
        if not self.memory_tier:
            return
        cfg, ckpt = self._cfg, self._cfg.checkpoint
        optimizers = [o for o in self._tracked.objects.values() if isinstance(o, torch.optim.Optimizer)]
        snapshot_bytes = estimate_snapshot_bytes(self._tracked.tree(), optimizers)
        try:
            needed = check_shm_capacity(ckpt.shm_dir, cfg.job_id, rank=cfg.rank, snapshot_bytes=snapshot_bytes,
                                        local_world_size=cfg.local_world_size)
        except ShmCapacityError as exc:
            if cfg.attempt == 0:
                raise
            self.memory_tier = False
            self._event("memory_tier_off", step=step, reason=str(exc))
            log.warning("rank %d: the memory tier is off for this attempt (%d), storage checkpoints go on: %s",
                        cfg.rank, cfg.attempt, exc)
            return
        log.info("rank %d: memory tier fits in %s: about %d bytes per snapshot, %d bytes for the node's "
                 "%d rank(s)", cfg.rank, ckpt.shm_dir, snapshot_bytes, needed, cfg.local_world_size)

    def after_step(self, step: int) -> None:
        """After a completed step (``step`` steps done): the checkpoint its number calls for, if any."""
        self._drop_unsettled(step)
        ckpt = self._cfg.checkpoint
        if self.memory_tier:  # a shared-memory snapshot; the agent persists some of them
            if step % ckpt.every_steps == 0:
                self.snapshot(step)
        elif ckpt.storage_every_steps and step % ckpt.storage_every_steps == 0:
            self.save(step)

    def checkpoint_now(self, step: int, in_step: bool = False) -> None:
        """Checkpoint the state after ``step`` completed steps: to memory (if on), and to storage.
        ``in_step``: called inside a step, where the pending snapshot's copy completes first (before
        the update nothing it copies has changed; after it, it is settled already)."""
        if in_step:
            self.settle()
        self._drop_unsettled(step)
        if self.memory_tier:
            self.snapshot(step, overlap=False)  # wherever the script calls it: all copied now
        self.save(step)

    def snapshot(self, step: int, overlap: bool = True) -> None:
        """Copy the state into this rank's shared-memory slot; with ``overlap`` (and :attr:`overlap`),
        parameters and optimizer state in the background, until :meth:`settle`."""
        try:
            if self._snapshots is None:
                ckpt = self._cfg.checkpoint
                hold = ckpt.persist_every_steps if ckpt.save_dir else 0  # kept until the agent persisted it
                self._snapshots = SnapshotWriter(ckpt.shm_dir, self._cfg.job_id, self._cfg.rank, hold_every=hold)
            tree = self._tracked.tree()
            deferred = self._tracked.unchanged_until_update(tree) if overlap and self.overlap else ()
            self._snapshots.write(step, tree, {"step": step}, deferred=deferred)
            self._metrics["shm_bytes"] = sum(p.stat().st_size for p in self._snapshots.paths if p.exists())
        except CheckpointError as exc:  # e.g. /dev/shm too small: storage checkpoints go on
            self.memory_tier = False
            self._save_failed(step, exc)

    def settle(self) -> float:
        """Before the parameters or optimizer state may change (the update, a recovery, the loop's
        end): wait for the pending snapshot's copy of them; return the seconds waited."""
        if self._snapshots is None or not self._snapshots.unsettled:
            return 0.0
        started = time.perf_counter()
        self._snapshots.settle()
        return time.perf_counter() - started

    def _drop_unsettled(self, step: int) -> None:
        """A snapshot still unsettled at a step's end: the step had no update the session saw, so its
        parameters may have changed during the copy: never commit it, and copy at the boundary from now on."""
        if self._snapshots is None or not self._snapshots.unsettled:
            return
        self._snapshots.abandon()
        if self.overlap:
            self.overlap = False
            self._event("snapshot_overlap_off", step=step, reason="a step ended without an update")
            log.info("rank %d: step %d ended without an optimizer update; memory-tier snapshots are copied at "
                     "the step boundary from now on (no overlap with the next step)", self._cfg.rank, step)

    def save(self, step: int) -> None:
        """Write this rank's part of ``step`` to storage; rank 0 commits it once every rank's
        part is durable (a collective: every rank calls this for the same step)."""
        if self.storage is None or self._cfg.checkpoint.save_dir is None:
            return
        rank, world_size = self._cfg.rank, self._cfg.world_size
        started = time.monotonic()
        ok = 1
        try:
            self.storage.save_rank(step, rank, world_size, self._tracked.tree(), {"step": step})
        except (CheckpointError, OSError) as exc:
            ok = 0
            self._save_failed(step, exc)
        self._injector.at(step, Phase.CHECKPOINT)
        # The step is committed only when every rank's part is durable.
        if self._all_min(ok) and rank == 0:
            try:
                self.storage.commit(step, world_size)
            except (CheckpointError, OSError) as exc:
                self._save_failed(step, exc)
                ok = 0
        if ok:
            self._event("checkpoint_saved", step=step, tier="storage", seconds=time.monotonic() - started)

    # -- rung `dump` (see unbroken.worker.inflight.DumpTarget) --------------------------------
    def check_dump(self) -> None:
        if self.storage is None or self._cfg.checkpoint.save_dir is None:
            raise CheckpointError("no storage tier (--save DIR) to dump to")

    def write_dump(self, step: int, ranks: list[int], states: dict[str, bytes]) -> None:
        """This rank's file of ``step``, and each lost rank's in ``ranks``: the replicated state is
        ours (a replica's is bit-identical), the per-rank state the lost rank's own (``states``,
        from the controller); without it, ours, and an event says so."""
        state: dict[str, Any] = self._tracked.tree()
        for rank in ranks:
            tree = state
            if rank != self._cfg.rank:
                own = states.get(str(rank))
                if own is not None:
                    tree = self._tracked.with_per_rank(state, decode_tree(own, f"rank {rank}'s per-rank state"))
                else:
                    log.warning("rank %d: dump of step %d: the controller kept no per-rank state of rank %d; "
                                "writing this rank's copy instead", self._cfg.rank, step, rank)
                    self._event("dump_per_rank_fallback", step=step, lost_rank=rank)
            self.storage.save_rank(step, rank, self._cfg.world_size, tree, {"step": step, "dump": True})

    def close(self) -> None:
        """Wait for the last snapshot's commit and unmap the slots (the files stay for the agent)."""
        if self._snapshots is not None:
            self._snapshots.close()
            self._snapshots = None

    def _save_failed(self, step: int, exc: Exception) -> None:
        self._event("checkpoint_failed", step=step, reason=str(exc))
        if not self._warned_save_failure:
            self._warned_save_failure = True
            log.warning("rank %d: checkpoint of step %d failed, training continues with the previous "
                        "checkpoint: %s (reported once)", self._cfg.rank, step, exc)
