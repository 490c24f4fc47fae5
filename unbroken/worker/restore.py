"""Restore at a job (re)start: every rank agrees on one step, then loads it.

Runs in the training thread of each rank, inside :meth:`unbroken.worker.session.Job.steps`,
once per process (a replacement process of an in-flight recovery does not come here: it
receives its state from replicas, see :mod:`unbroken.worker.inflight`). It sees only narrow
collaborators: :class:`RestoreSources` (tiers, controller link, all-reduce) and the tracked state.

Sources of a rank, by the resume rule (docs/checkpoints.md, "Resuming: --load and --save"): a new launch
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

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from unbroken.checkpoint.memory import SlotState, read_header
from unbroken.checkpoint.memory_reader import SnapshotReader
from unbroken.checkpoint.shm_files import peer_marker_path, read_ours
from unbroken.checkpoint.storage import StorageTier
from unbroken.errors import CheckpointError, FatalError, JobFailed, NoCheckpoint
from unbroken.recovery.restore_point import MEMORY, PEER_MEMORY
from unbroken.worker.control import ControlClient
from unbroken.worker.tracked import TrackedState
from unbroken.worker_config import WorkerConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoredSteps:
    """A storage directory restore may load from; ``own_run_only``: only the steps this run
    committed count (the run's --save directory on a restart), else all of them (--load's)."""

    tier: StorageTier
    own_run_only: bool

    def steps(self, steps: list[int]) -> list[int]:
        """The steps of `steps` (newest first) restore may take from this directory."""
        return self.tier.own_steps(steps) if self.own_run_only else steps


@dataclass(frozen=True)
class RestoreSources:
    """What one rank restores from and with whom it agrees (the session builds it by the
    resume rule: memory and the run's own --save steps only on a restart, attempt > 0)."""

    rank: int
    attempt: int
    recovery_timeout_s: float
    memory: SnapshotReader | None  # this node's shared-memory snapshots (under `unbroken run`)
    stores: tuple[StoredSteps, ...]  # in the order restore prefers them
    control: ControlClient | None  # the controller decides the step; None: the ranks agree by all_min
    all_min: Callable[[int], int]  # an all-reduce MIN over every rank


def build_sources(cfg: WorkerConfig, *, own_storage: StorageTier | None, control: ControlClient | None,
                  all_min: Callable[[int], int]) -> RestoreSources:
    """The sources of rank ``cfg.rank`` by the resume rule: a new launch (attempt 0) only
    --load's directory; a job-level restart inside the run this node's shared-memory
    snapshots (under `unbroken run`) and this run's own steps in `own_storage` (--save's)
    first, then --load's."""
    own_run = cfg.attempt > 0
    ckpt = cfg.checkpoint
    memory = SnapshotReader(ckpt.shm_dir, cfg.job_id, cfg.rank) if own_run and control is not None and cfg.job_id \
        else None
    stores = ([StoredSteps(own_storage, own_run_only=True)] if own_run and own_storage is not None else []) \
        + ([StoredSteps(StorageTier(ckpt.load_dir), own_run_only=False)] if ckpt.load_dir else [])
    return RestoreSources(rank=cfg.rank, attempt=cfg.attempt, recovery_timeout_s=cfg.worker.recovery_timeout_s,
                          memory=memory, stores=tuple(stores), control=control, all_min=all_min)


def restore(src: RestoreSources, tracked: TrackedState, event: Callable[..., None]) -> int:
    """Agree on the step to resume from, load it into the tracked state; return the step
    (0 when there is nothing to restore)."""
    if src.memory is None and not src.stores:
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
    state, tier, where = loaded
    tracked.load_tree(state)
    seconds = time.monotonic() - started
    log.info("rank %d: restored step %d from %s (%s) in %.3f s", src.rank, agreed, tier, where, seconds)
    event("restored", step=agreed, tier=tier, dir=where, seconds=seconds)
    return agreed


def _agree(src: RestoreSources, round_: int, bound: int | None) -> int:
    """The step every rank loads in round ``round_`` (-1: none, start fresh)."""
    if src.control is None:
        return src.all_min(_newest_available(src, bound))
    memory_steps = sorted({s for s, _ in src.memory.committed() if bound is None or s <= bound}, reverse=True) \
        if src.memory is not None else []
    peer_steps = _peer_steps(src)
    # Listed by metadata only (cheap); a file that rotted in place fails its checksum at
    # load, and the next round goes older.
    storage_steps = sorted({s for store in src.stores
                            for s in store.steps(store.tier.loadable_steps(src.rank, at_or_below=bound))},
                           reverse=True)
    timeout_s = src.recovery_timeout_s
    step = src.control.restore_at(round_, memory_steps, storage_steps, timeout_s,
                                  peer_steps=[s for s in memory_steps if s in peer_steps])
    if step is None:
        raise JobFailed(f"rank {src.rank}: no restore decision from the controller within {timeout_s:.0f} s "
                        f"(attempt {src.attempt}, round {round_}; offered memory steps {memory_steps}, storage "
                        f"steps {storage_steps}); the controller is gone or another rank never offered. "
                        "The setting is --recovery-timeout-s; the controller's events.jsonl says more")
    return step


def _peer_marker(src: RestoreSources) -> dict | None:
    """The marker the agent left when it fetched this rank's snapshot from a peer node's copy."""
    marker = read_ours(peer_marker_path(src.memory.dir, src.memory.job_id, src.rank))
    try:
        value = json.loads(marker) if marker else None
    except ValueError:
        return None
    return value if isinstance(value, dict) and type(value.get("seq")) is int else None


def _peer_steps(src: RestoreSources) -> set[int]:
    """The committed memory steps of this rank that are the copy fetched from a peer node."""
    marker = _peer_marker(src) if src.memory is not None else None
    if marker is None:
        return set()
    headers = [read_header(p) for p in src.memory.paths]
    return {h.step for h in headers if h is not None and h.state == SlotState.COMMITTED and h.seq == marker["seq"]}


def _memory_tier(src: RestoreSources) -> str:
    """``peer_memory`` when the snapshot just loaded is the copy fetched from a peer node, else ``memory``."""
    marker = _peer_marker(src)
    return PEER_MEMORY if marker is not None and marker["seq"] == src.memory.last_seq else MEMORY


def _newest_available(src: RestoreSources, bound: int | None) -> int:
    steps = [s for s, _ in src.memory.committed()] if src.memory is not None else []
    for store in src.stores:  # newest first; the tensor files' checksums are verified here
        stored = next((s for s in store.steps(store.tier.loadable_steps(src.rank, at_or_below=bound))
                       if _verifies(store.tier, s, src.rank)), None)
        steps += [stored] if stored is not None else []
    return max((s for s in steps if bound is None or s <= bound), default=-1)


def _verifies(tier: StorageTier, step: int, rank: int) -> bool:
    try:
        tier.verify_rank(step, rank)
        return True
    except CheckpointError as exc:
        log.warning("skipping checkpoint step %d for rank %d: %s", step, rank, exc)
        return False


def _load_step(src: RestoreSources, tracked: TrackedState, step: int) -> tuple[dict, str, str] | None:
    """(state, tier, directory) of ``step`` for this rank, memory first, else the stores in
    order; None if none loads it."""
    if src.memory is not None:
        try:
            # Straight into the tensors of the freshly built model and optimizer: no new
            # allocation (page faults). If it fails, another step is loaded over them.
            state = src.memory.load(step, into=tracked.tree())[0]
            return state, _memory_tier(src), str(src.memory.dir)
        except (NoCheckpoint, CheckpointError) as exc:
            if not isinstance(exc, NoCheckpoint):
                log.warning("rank %d: shared-memory snapshot of step %d unusable: %s", src.rank, step, exc)
    for store in src.stores:
        if not store.steps([step]):
            continue
        try:
            return store.tier.load_rank(step, src.rank)[0], "storage", str(store.tier.root)
        except CheckpointError as exc:
            log.warning("rank %d: checkpoint of step %d in %s unusable: %s", src.rank, step, store.tier.root, exc)
    return None
