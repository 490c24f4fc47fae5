"""The step in flight of one rank's session, and what runs at its boundaries.

A :class:`StepBoundary` owns the step in flight: its index (== the number of completed
steps), its phase, whether it committed and whether it completed. In order, it carries out:

* at the start (:meth:`StepBoundary.begin`): under `unbroken run`, the step-start capture a
  dropped step is redone from (:class:`~unbroken.worker.rollback.StepStates`);
* at each phase (:meth:`StepBoundary.enter`): the progress report (``compute`` carries this
  rank's own step-start state), the NaN/Inf check entering ``sync``, the injected faults
  planned for it; entering ``update``, first the step's commit (worker/commit.py), before
  anything changes (the report sent with it carries the state after compute); entering ``sync``
  in a step that commits without a vote, this rank's own state, which it keeps if it is cut
  inside the reduction (:meth:`StepBoundary.reduction_cut`);
* at the end (:meth:`StepBoundary.end`): ``done``, the ready announcement after the first
  committed step, the step's time; then (:meth:`StepBoundary.report_progress`) the step report
  with its metrics;
* when the step is dropped (:meth:`StepBoundary.drop`): its start loaded back, unless it
  committed.

Phases of a step, in order: ``compute`` -> ``sync`` -> ``update`` -> ``done``. Lives in the
training thread of one process, owned by its :class:`~unbroken.worker.session.Job`.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from unbroken.checkpoint.own_state import OwnStateWriter
from unbroken.errors import CollectiveAborted, ConfigError
from unbroken.faults.inject import FaultInjector
from unbroken.names import STEP_PHASES, Phase
from unbroken.worker import integrity, rollback, untracked
from unbroken.worker.checkpointing import Checkpointer
from unbroken.worker.commit import ReductionCut
from unbroken.worker.control import ControlClient
from unbroken.worker.tracked import TrackedState

log = logging.getLogger(__name__)


class StepBoundary:
    """The step in flight of one rank (see the module docstring).

    ``control`` gives the controller link (None: not under `unbroken run`, or closed), ``generation``
    the current generation, ``ready_fields`` what the ready announcement carries; ``metrics`` is the
    session's dict of this step's progress metrics (shared with the checkpointer).
    """

    def __init__(self, rank: int, *, finite_check: bool, control: Callable[[], ControlClient | None],
                 generation: Callable[[], int], commit: Callable[[int, Callable[[], None]], bool],
                 voteless: Callable[[int], bool],
                 ready_fields: Callable[[], dict[str, Any]],
                 tracked: TrackedState, injector: FaultInjector, ckpt: Checkpointer,
                 metrics: dict[str, Any], own_state: OwnStateWriter | None = None) -> None:
        self.rank, self._finite_check = rank, finite_check
        self._control, self._generation, self._ready_fields = control, generation, ready_fields
        self._commit_step = commit  # the step's commit vote (InFlight.commit)
        self._voteless = voteless  # whether a step commits without a vote (InFlight.voteless)
        self._own_state = own_state  # this rank's own state for its agent (checkpoint/own_state.py)
        self._tracked, self._injector, self._ckpt, self._metrics = tracked, injector, ckpt, metrics
        self.step, self.phase = 0, Phase.DONE  # the step in flight (== number of completed steps), its phase
        self.in_step = False
        self.completed = False  # the last step yielded by steps() completed (its block ended)
        self._started_t, self._last_step_s = time.monotonic(), 0.0
        self._states = rollback.StepStates(rank)  # the step start, under `unbroken run`
        self._committed = self._announced_ready = False
        self._reduced_after_update = False
        #: Whether the script changes state after a reduction that begins after its update (see _check_order):
        #: None until a step with such a reduction completed here (watched), then sticky once True.
        self._tail_changes: bool | None = None
        self._after_reduction: untracked.TrackedWatch | None = None
        self._own_kept = False  # the step's state as its reduction began is in node memory or sent (SyncState)
        self._synced_later = False  # the step committed without its commit report (Progress.synced)
        self._moved_told = False  # the controller was told this rank's state moved after an update

    def begin(self) -> None:
        self._started_t = time.monotonic()
        if self._control() is not None:  # to redo this step exactly if it is dropped
            self._states.begin(self.step, *self._tracked.step_start())
        self.in_step, self._committed = True, False
        self._own_kept = self._synced_later = False  # see _commit
        self._reduced_after_update = False  # see _check_order
        self.completed = False

    def enter(self, name: str, step: int | None = None) -> None:
        """Record the phase of the step in flight; fires injected faults planned for it."""
        if name not in STEP_PHASES and name != Phase.CHECKPOINT:
            raise ConfigError(f"unknown phase {name!r} (allowed: {', '.join(STEP_PHASES)}, checkpoint)")
        if self.in_step and name in (Phase.SYNC, Phase.UPDATE) and self.phase == name:
            return  # already there: job.all_reduce or the optimizer's step hook marked it
        if name == Phase.UPDATE:
            self._commit()  # before anything changes; only then is this rank in 'update' (it vouches for the commit)
        self.phase = name
        control = self._control()
        if control is not None:  # where each rank is (and, at 'compute', its own step-start state)
            own = self._states.start_report if name == Phase.COMPUTE else rollback.NO_REPORT
            moved = name == Phase.COMPUTE and self._states.moved_after_update is not None and not self._moved_told
            self._moved_told = self._moved_told or moved
            control.progress(self.step, name, state=own.state, state_same=own.same, moved=moved)
        if name == Phase.SYNC and control is not None and self._finite_check:
            integrity.check_finite(self._tracked.objects, self.rank, self.step)  # before the reduction spreads it
        if name == Phase.SYNC and control is not None and self.in_step:  # (voting steps too: it learns sooner
            blob = self._states.at_sync(self._tracked.per_rank_tree())  # whether the state moves in the reduction)
            if blob is not None and self._voteless(self.step):  # its state after compute, before any rank updates:
                if self._own_state is not None:
                    self._own_state.write(self.step, blob)  # kept by the agent, if this process dies
                else:  # (no file of it on this node: another node's ranks, whose loss takes a file along)
                    own = self._states.report_of(blob)
                    control.sync_state(self._generation(), self.step, state=own.state, state_same=own.same)
                self._own_kept = True
        self._injector.at(self.step if step is None else step, name)

    def advance(self, name: str, *_hook_args: Any) -> None:
        """Move the step in flight on to ``name`` unless it is there or past it: 'sync' when a
        collective starts, 'update' (the commit first) from a tracked torch optimizer's step
        pre-hook, the first state change of a step. The manual path needs no job.phase calls."""
        self._check_order(name)
        if self.in_step and self.phase in STEP_PHASES and STEP_PHASES.index(self.phase) < STEP_PHASES.index(name):
            self.enter(name)

    def waiting(self, work: Any) -> None:
        """A collective other than a reduction was issued in the step's compute (DDP's broadcast of its
        buffers as the forward begins): if it blocks, the hang rule hears the rank waits in a collective
        (a peer that never reached it is then behind it, and blamed)."""
        control = self._control()
        if control is not None and self.in_step and self.phase == Phase.COMPUTE:
            control.reports.collective(self.step, work)

    def on_optimizer_phase(self, name: str, step: int) -> None:
        self._check_order(name)
        if name != Phase.DONE:  # 'done' is recorded at the end of the step by the boundary
            self.enter(name)

    def _check_order(self, name: str) -> None:
        """A step commits at its first optimizer update, once every rank finished its reductions. A
        reduction after that update is harmless (a logged loss) unless an optimizer then updates
        from it (a GAN's generator after its discriminator), or tracked state changes after it (a
        scheduler stepped after a logging all-reduce): a fault inside that reduction rolls the step
        forward without them. What the script does is learned (an update there at once; changed
        tracked objects at the end of the first step that had such a reduction, fingerprinted at
        its start), and a survivor cut inside one says so in its pause report (:attr:`cut_in_tail`):
        the controller then refuses the in-flight recovery, and the job restarts from a checkpoint."""
        if not (self.in_step and self._committed):
            return
        if name == Phase.SYNC:
            if not self._reduced_after_update and self._tail_changes is None and self._after_reduction is None:
                self._after_reduction = untracked.TrackedWatch(self._tracked.objects)
            self._reduced_after_update = True
        elif name == Phase.UPDATE and self._reduced_after_update:
            self._learn_tail(["the modules (an optimizer updated)"])

    def _learn_tail(self, changed: list[str]) -> None:
        """What a step did after a reduction that began after its update (``changed``: what moved)."""
        if changed and not self._tail_changes:
            log.warning("rank %d: step %d changed %s after a reduction that began after the step's first optimizer "
                        "update: a fault inside such a reduction is recovered by a restart from the newest "
                        "checkpoint, not in flight. To keep it in flight, move that reduction to the end of the "
                        "step (or before the optimizer step), or give each optimizer its own step",
                        self.rank, self.step, ", ".join(changed))
        self._tail_changes = bool(changed) or bool(self._tail_changes)

    @property
    def cut_in_tail(self) -> bool:
        """Paused inside a reduction after the step's update, where the script may still change state
        after it (not known harmless): rolling this step forward would miss that."""
        return self.in_step and self._committed and self._reduced_after_update and self._tail_changes is not False

    def _commit(self) -> None:
        """Entering ``update``: the reduction is done; join the step's commit vote, report the
        reduction done (with this rank's state after compute), and pass the vote
        (recovery/consistency.py). Not passed here: paused in the vote until the controller
        decides; CollectiveAborted unless the step committed."""
        control = self._control()
        if control is None or self._committed:
            return
        gen, step = self._generation(), self.step
        # A roll forward resumes from the state after compute. Where the step commits without a vote and that
        # state is in node memory (written as the reduction began, unchanged since), the commit report is not
        # sent: the step's end tells the controller (Progress.synced), its agent the state if this process dies.
        kept = self._own_kept and self._voteless(step)
        own = self._states.after_compute(self._tracked.per_rank_tree(), report=not kept)
        self._synced_later = own is None
        joined = (lambda: None) if own is None else \
            (lambda: control.synced(gen, step, state=own.state, state_same=own.same))  # noqa: E731
        if not self._commit_step(step, joined):
            raise CollectiveAborted(f"rank {self.rank}: step {self.step} was not committed (abort order for "
                                    f"generation {control.abort_gen}: {control.abort_reason})")
        self._committed = True
        self.phase = Phase.UPDATE  # past the vote: a pause from here on reports update (consistency.voted_step)
        self._metrics["snapshot_wait_s"] = self._ckpt.settle()  # the update may change what it still copies

    def reduction_cut(self) -> ReductionCut | None:
        """Before a drop: whether the step in flight was cut inside the reduction of a step that commits
        without a vote (worker/commit.py), and this rank's own state at the cut if it is its state after the
        step's compute (StepStates.at_cut); None if it was not cut there."""
        if not (self.in_step and self.phase == Phase.SYNC and not self._committed and self._states.in_sync
                and self._voteless(self.step)):
            return None
        state, why = self._states.at_cut(self._tracked.per_rank_tree())
        return ReductionCut(state, why)

    def drop(self) -> str:
        """Drop the step in flight (gradients, what it changed before its commit); the phase it paused in."""
        pause_phase = self.phase if self.in_step else Phase.COMPUTE  # between steps: the next one's start
        self._ckpt.settle()  # before recovery writes into the state (a dropped step changed none of it)
        self._tracked.drop_grads()
        capture = self._states.capture
        if self.in_step and capture is not None and not self._committed:
            self._tracked.load_rollback(capture.local(), capture.per_rank_tree())
        self.in_step, self._after_reduction = False, None  # (a watch of this step's tail: it never ended)
        return pause_phase

    def end(self, index: int) -> None:
        watch, self._after_reduction = self._after_reduction, None
        if watch is not None:  # a reduction after the update began in this step: what changed after it?
            self._learn_tail(watch.changed())
        self.completed = True
        self.phase = Phase.DONE
        self.in_step = False
        self._announce_ready()
        self.step = index + 1
        self._last_step_s = time.monotonic() - self._started_t

    def _announce_ready(self) -> None:
        control = self._control()
        if control is None or self._announced_ready or not self._committed:
            return
        self._announced_ready = True
        control.session_ready(**self._ready_fields())

    def report_progress(self) -> None:
        control = self._control()
        if control is not None:
            control.step_done(self.step, dict(self._metrics, step_s=self._last_step_s), synced=self._synced_later)
