"""The persister: an agent thread that copies committed shared-memory snapshots to storage.

It runs in the agent (never in a worker), niced and paced (it works :data:`DUTY` of the
wall time while it writes, and sleeps the rest), so a persisting node slows training by as
little as possible; it copies a snapshot out of its slot first and releases the slot at
once, so the memory tier never waits for the storage write. Every ``poll_s`` it looks at its ranks' committed
snapshots; when every one of them holds the same step that is due (a multiple of
``--persist-every-steps``) and newer than the
last one persisted, it writes each rank's files of that step (temporary name, fsync,
rename) and tells the controller, which writes the manifest once every rank of the job has
its files there (an explicit ``job.checkpoint()`` writes storage from the worker). Snapshots that commit while it writes are not queued: the next round takes
the newest, so stale ones are skipped and the trainer is never blocked.

A failure (disk full, ...) is reported once per step and never stops training; no
manifest is written for that step, so the previous checkpoint stays the newest.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from unbroken.checkpoint import shm_files
from unbroken.checkpoint.memory_reader import SnapshotReader
from unbroken.checkpoint.storage import StorageTier
from unbroken.errors import CheckpointError, NoCheckpoint
from unbroken.worker_config import CheckpointConfig

log = logging.getLogger(__name__)

NICE = 10  # the persister thread's niceness: the training processes come first
DUTY = 0.25  # the share of wall time the persister works while it persists (it sleeps the rest)


class DutyCycle:
    """Paces background work to a share of the wall time: called between slices of work, it
    sleeps so that work / (work + sleep) stays at ``duty``. ``stop`` cuts the sleeps short (the
    final pass at shutdown runs at full speed)."""

    def __init__(self, duty: float, stop: threading.Event) -> None:
        if not 0 < duty <= 1:
            raise ValueError(f"duty must be in (0, 1], got {duty}")
        self._duty, self._stop, self._t = duty, stop, time.monotonic()

    def restart(self) -> None:
        self._t = time.monotonic()

    def __call__(self) -> None:
        worked = time.monotonic() - self._t
        if self._duty < 1 and worked > 0:
            self._stop.wait(worked * (1 - self._duty) / self._duty)
        self._t = time.monotonic()


class Persister:
    def __init__(self, ckpt: CheckpointConfig, job_id: str, world_size: int | Callable[[], int],
                 ranks: Callable[[], list[int]],
                 report: Callable[[int, list[int], float, str], None], poll_s: float = 0.2,
                 duty: float = DUTY, run_id: str | None = None) -> None:
        self._ckpt = ckpt
        self._job_id = job_id
        # The job's world size: a callable where the agent learns it from the controller's orders (a
        # standby agent's own flags do not say it).
        self._world_size = world_size if callable(world_size) else (lambda: world_size)
        self._ranks = ranks  # the ranks this agent hosts now
        self._report = report
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._pace = DutyCycle(duty, self._stop)
        self._copier = _Copier()
        self._storage = StorageTier(ckpt.save_dir, keep=ckpt.keep, pace=self._pace, run_id=run_id)
        self._last = -1
        self._failing = False  # the last persist failed: later failures are not reported again
        self._buffer: Any = None  # the tensors of the last snapshot read, reused for the next
        self._ranks_at_stop: list[int] = []
        self._thread = threading.Thread(target=self._loop, name="unbroken-persister", daemon=True)

    def start(self) -> None:
        self._copier.start()  # from the agent's thread: at its priority, not the persister's
        self._thread.start()

    def stop(self) -> None:
        """Stop, after persisting the newest due snapshot not yet persisted (nothing is lost at
        the end of a job)."""
        self._stop.set()
        self._thread.join(timeout=30)
        ranks = self._ranks_at_stop or self._ranks()
        step = self._due_step(ranks)
        if step is not None:
            self._persist(step, ranks)
        self._copier.stop()

    def _loop(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
        except (AttributeError, OSError):  # not Linux: plain priority
            pass
        while not self._stop.wait(self._poll_s):
            ranks = self._ranks()
            self._ranks_at_stop = ranks or self._ranks_at_stop  # the workers may be gone at stop()
            try:
                step = self._due_step(ranks)
            except (CheckpointError, OSError) as exc:  # e.g. the shm dir went away: try again later
                log.debug("persister: cannot list the snapshots: %s", exc)
                continue
            if step is not None:
                self._persist(step, ranks)

    def _due_step(self, ranks: list[int]) -> int | None:
        """The newest step every local rank has committed in memory and that is due to persist."""
        if not ranks:
            return None
        common: set[int] | None = None
        for rank in ranks:
            reader = SnapshotReader(self._ckpt.shm_dir, self._job_id, rank)
            steps = {s for s, _ in reader.committed()}
            common = steps if common is None else common & steps
        every = self._ckpt.persist_every_steps
        due = [s for s in common or () if s > self._last and every and s % every == 0]
        return max(due, default=None)

    def _persist(self, step: int, ranks: list[int]) -> None:
        started = time.monotonic()
        self._last = step
        try:
            for rank in ranks:  # held by the writers until released: no race with them
                # Into the tensors of the last load (ranks of a node mostly hold the same shapes):
                # no fresh allocation, no page faults competing with training, every time.
                self._pace.restart()
                reader = SnapshotReader(self._ckpt.shm_dir, self._job_id, rank)
                state, meta = self._copier.load(reader, step, self._buffer)
                self._buffer = state
                # Copied out: the writer may use the slot again while the (paced) write goes on.
                self._mark(step, rank)
                self._storage.save_rank(step, rank, self._world_size(), state, meta)
        except (CheckpointError, NoCheckpoint, OSError) as exc:
            self._release(step, ranks)
            self._failed(step, ranks, time.monotonic() - started, exc)
            return
        self._failing = False
        self._report(step, ranks, time.monotonic() - started, "")

    def _release(self, step: int, ranks: list[int]) -> None:
        """Release the held snapshots after a failure, so the next due step is tried instead."""
        for rank in ranks:
            self._mark(step, rank)

    def _mark(self, step: int, rank: int) -> None:
        """mark_persisted; a full shm dir may refuse even this marker: the write to storage goes
        on, the writer keeps holding one slot and the memory tier goes on in the other."""
        try:
            shm_files.mark_persisted(self._ckpt.shm_dir, self._job_id, rank, step)
        except (CheckpointError, OSError) as exc:
            log.debug("persister: cannot mark step %d of rank %d persisted: %s", step, rank, exc)

    def _failed(self, step: int, ranks: list[int], seconds: float, exc: BaseException) -> None:
        """Warn and report (event persist_failed) the first failure of a run of failures only."""
        if self._failing:
            log.info("persisting step %d failed again: %s", step, exc)
            return
        self._failing = True
        log.warning("persisting step %d failed; the previous checkpoint stays the newest, training goes on "
                    "(later failures are not reported until one succeeds): %s", step, exc)
        self._report(step, ranks, seconds, str(exc) or type(exc).__name__)


class _Copier:
    """A thread at the agent's own priority that copies snapshots out of their slots for the
    niced persister thread: a slot stays pinned (and its writer skips it) only for a fast copy,
    even while training keeps every core busy; the slow part, the write, stays niced and paced."""

    def __init__(self) -> None:
        self._requests: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name="unbroken-persist-copy", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._requests.put(None)

    def load(self, reader: SnapshotReader, step: int, into: Any) -> tuple[Any, dict]:
        """``reader.load(step, into=into)``, run in the copier thread (here if it is not running)."""
        if not self._thread.is_alive():
            return reader.load(step, into=into)
        done: Future = Future()
        self._requests.put((done, reader, step, into))
        return done.result()

    def _serve(self) -> None:
        while (request := self._requests.get()) is not None:
            done, reader, step, into = request
            try:
                done.set_result(reader.load(step, into=into))
            except BaseException as exc:  # noqa: BLE001 - handed to the persister thread
                done.set_exception(exc)
