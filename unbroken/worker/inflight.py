"""In-flight recovery inside a worker: pause, regroup, receive or send state, resume.

:class:`InFlight` runs in the training thread, called from
:meth:`unbroken.worker.session.Job.steps`:

* a **survivor** left a step because its collective was aborted (the controller's
  abort order, or gloo reporting a dead peer). The session drops what the step computed
  (gradients, RNG draws); the survivor reports itself paused and waits for the regroup order;
* a **replacement** (a new process started for a lost rank) waits for the same order
  right after joining (inside ``unbroken.init()``), and receives its state in ``job.steps()``.

The order names the next generation, the step to resume at (the first uncommitted one,
see :mod:`unbroken.recovery.consistency`) and the replaced ranks. Every rank then builds
the generation's process group on a fresh store prefix and takes part in the same
sequence of collectives: recoverable state (:class:`~unbroken.worker.api.RecoverableState`)
first rebuilds itself from live holders, then every replicated plain object goes point to
point to the replaced ranks, each from one survivor (spread over the survivors so pieces
travel in parallel: :mod:`unbroken.recovery.transfer_plan`, :mod:`unbroken.comm.p2p`), into
the replacement's own tensors; a survivor that sends nothing receives nothing. Per-rank state (the RNG streams, per-rank
objects: :mod:`unbroken.worker.tracked`) is each rank's own: a replaced process loads the
copy the controller kept of *its* state (in the order); only for ranks the order lists in
``fallback`` (the controller had none) does the lowest survivor's copy go instead. A rank
repaired in place (rung `retry`) keeps its own per-rank state. A second fault meanwhile aborts the
transfer and the whole sequence starts again for the next generation.

States: ``running`` (``pending`` False) -> a fault noted (:meth:`note_fault`) or an abort
order seen -> ``pending`` -> :meth:`survive` -> paused -> regrouped (``gen`` + 1, a new
``group``, the old one in the ``graveyard``) -> transferred -> ``running``. ``needs_state``
is True from the start of a replacement, or of a survivor whose state was damaged, until
its transfer is done.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from unbroken.comm import generation_group, movers, wait_all
from unbroken.comm.wait import AbortWatch
from unbroken.comm.p2p import exchange_states
from unbroken.errors import CheckpointError, CollectiveAborted, JobFailed, StateDamaged
from unbroken.faults.inject import FaultInjector
from unbroken.names import Phase
from unbroken.parallel import ddp as ddp_generations
from unbroken.parallel import dtensor_state
from unbroken.parallel.fabric import Fabric
from unbroken.parallel.group import SurvivingGroup
from unbroken.protocol.messages import Dump, Regroup
from unbroken.recovery.mesh_map import MeshReplicaMap, object_moves
from unbroken.recovery.transfer_plan import Move, involved, movers as movers_in, plan_moves
from unbroken.worker import wrappers
from unbroken.worker.commit import CommitVotes, ReductionCut
from unbroken.worker.control import ControlClient
from unbroken.state.blob import decode_tree
from unbroken.worker.tracked import TrackedState
from unbroken.worker_config import WorkerConfig

log = logging.getLogger(__name__)
_PER_RANK = "per-rank state"  # the transfer's key for a fallback rank's per-rank state

class DumpTarget(Protocol):
    """Where rung `dump` writes (the session's :class:`~unbroken.worker.checkpointing.Checkpointer`)."""

    def check_dump(self) -> None:
        """CheckpointError unless a storage tier can take a dump."""

    def write_dump(self, step: int, ranks: list[int], states: dict[str, bytes]) -> None:
        """Write this rank's state as the state of each of ``ranks`` (a replica's is bit-identical),
        with a lost rank's own per-rank state from ``states`` (rank as str -> encoded)."""


class InFlight:
    """One rank's side of in-flight recovery: owns the process group of the current
    generation, the generation number, the graveyard of abandoned groups and work, and
    whether this rank needs its state from replicas (see the module docstring)."""

    def __init__(self, cfg: WorkerConfig, *, device: torch.device, control: ControlClient | None,
                 store: dist.Store | None, group: dist.ProcessGroup | None, tracked: TrackedState,
                 injector: FaultInjector, dump: DumpTarget, fabric: Fabric | None = None) -> None:
        self._cfg, self._device, self._control, self._store = cfg, device, control, store
        self._fabric = fabric  # the job's surviving groups (the default group), if any
        self._tracked, self._injector = tracked, injector
        self._dump_target = dump
        self.gen = 0
        self.group = group
        self.graveyard: list[Any] = []  # never emptied early: see FACTS.md
        self.needs_state = cfg.replacement  # a replacement receives its state from replicas
        self._keeps_own = False  # repaired in place (rung `retry`): its per-rank state is its own
        self.damaged: StateDamaged | None = None  # this rank's state is damaged: repair from replicas
        self.pause_phase: str = Phase.COMPUTE
        self._cut_in_tail = False  # paused inside a reduction after the update (StepBoundary.cut_in_tail)
        self._cut: ReductionCut | None = None  # paused inside the reduction of a vote-less step (worker/commit.py)
        self.fault_noted = False  # a fault inside a step: recover before the next one
        self._paused_step = 0
        self._order: Regroup | None = None
        self._held: Regroup | Dump | None = None  # an order received while paused in a commit vote
        self._joined_t: float | None = None  # a replacement: when it joined its generation (in init())
        self.replica_map: MeshReplicaMap | None = None  # the job's mesh (job.mesh): who holds whose objects
        self.votes = CommitVotes(cfg.rank, device=device, injector=injector, tracked=tracked, fabric=fabric,
                                 mesh=lambda: self.replica_map is not None)
        self.after_transfer: list[Callable[[], None]] = []  # run by every rank last in each transfer
        # True once the controller ordered this generation's collectives abandoned; the waits
        # blocked on it (comm/wait.py) are woken by the control reader thread's abort (_fire_abort).
        self.should_abort = AbortWatch(self._abort_due)
        if fabric is not None:
            self.graveyard = fabric.graveyard  # one graveyard (the groups hold it): close() checks it
        if control is not None:
            control.on_abort = self._fire_abort

    def _fire_abort(self, abort_gen: int, reason: str) -> None:
        """The control reader thread, on each abort order (and when the controller is lost): wake
        every wait blocked on ``should_abort``; an order for the fabric's generation also fails its
        collectives (a stock DDP's all-reduce among them) at once."""
        self.should_abort.wake()
        if self._fabric is not None and abort_gen > self._fabric.generation:
            self._fabric.signal.fire(reason or f"abort order for generation {abort_gen}")

    # -- is a recovery due? -------------------------------------------------------------
    def _abort_due(self) -> bool:
        return self._control is not None and self._control.abort_gen > self.gen

    @property
    def pending(self) -> bool:
        """A recovery must run before the next step (a fault, an abort order, a cut step)."""
        return self.fault_noted or self.should_abort() or (self._control is not None and self._tracked.step_pending())

    def is_recoverable(self, exc: Exception) -> bool:
        """A collective that failed or was aborted because a peer was lost, or state damaged in
        memory, under a controller (which repairs both from replicas)."""
        if self._control is None:
            return False
        if isinstance(exc, (StateDamaged, CollectiveAborted)):
            return True
        if isinstance(exc, RuntimeError) and self._fabric is not None and self._fabric.signal.failed:
            return True  # a collective on a surviving group (e.g. DDP's) failed or was aborted
        notes = getattr(exc, "__notes__", ())
        return isinstance(exc, RuntimeError) and any(n.startswith("unbroken: during the") for n in notes)

    def note_fault(self, step: int, exc: Exception) -> bool:
        """A fault inside step ``step``: True if it is recovered in flight (the step is dropped)."""
        if not self.is_recoverable(exc):
            return False
        if isinstance(exc, StateDamaged):
            self.damaged = exc  # rung `retry`: this rank's state comes from replicas
        log.warning("rank %d: step %d aborted (%s); recovering in flight", self._cfg.rank, step,
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        self.fault_noted = True
        return True

    # -- the commit vote (unbroken.recovery.consistency) -------------------------------------
    def commit(self, step: int, joined: Callable[[], None]) -> bool:
        """Whether step ``step`` committed: its vote passed here, or, paused in it, the controller
        decided so (:meth:`commit_vote`, :meth:`pause_in_vote`)."""
        return self.commit_vote(step, joined) or self.pause_in_vote(step)

    def commit_vote(self, step: int, joined: Callable[[], None]) -> bool:
        """Step ``step``'s commit (worker/commit.py): its vote, or none where the step needs none.
        ``joined()`` runs once this rank joined the vote (it reports the reduction done). True: the
        update may begin. False: an abort order or a peer's loss came first (see :meth:`pause_in_vote`)."""
        if not self.voteless(step) and self.group is not None and self._cfg.world_size > 1:
            return self.votes.vote(step, self.gen, self.group, joined, self.should_abort, self.graveyard)
        self._injector.at(step, Phase.VOTE)  # (where the vote would be: the reduction done, not reported yet)
        joined()
        return True

    def voteless(self, step: int) -> bool:
        """Whether step ``step`` commits without a vote (worker/commit.py)."""
        return self.group is not None and self._cfg.world_size > 1 and not self.votes.needed(step, self.gen)

    def pause_in_vote(self, step: int) -> bool:
        """The vote of ``step`` did not pass here: report this rank paused in it (its gradients whole)
        and wait for the decision. True: the step committed (the controller's record, or another
        rank passed the vote), so its update goes on from this rank's own gradients, and the order
        waits for the step's end (:meth:`survive`). False: the step is dropped, as any aborted step."""
        control = self._control
        if control.committed_step >= step:  # the abort order said so: every rank reported its reduction
            return True
        self._paused_step, self.pause_phase, self._cut_in_tail = step, Phase.SYNC, False
        reported = control.abort_gen
        self._announce(reported)
        order = self._held = self._next_order(reported)
        return order.step > step if isinstance(order, Dump) else order.resume_step > step

    def barrier_before_teardown(self) -> None:
        """At the end of a job that went through a regroup on surviving groups: wait until every rank
        got here (its script is done) before any rank tears its groups down. Why: a rank holding an
        abandoned op of an old generation can be aborted by gloo when a peer closes that op's
        connection; once every rank is past its script, such a crash costs nothing (the controller
        counts a rank that dies after its loop as finished). Best effort: an error is logged."""
        if self._fabric is None or self._fabric.generation <= 0 or self.group is None:
            return
        try:
            wait_all([self.group.barrier()], None, self.graveyard, "the barrier before the teardown")
        except Exception as exc:  # noqa: BLE001 - the job is over; tear down anyway
            log.warning("rank %d: barrier before the teardown failed: %s", self._cfg.rank, exc)

    def release_graveyard(self) -> bool:
        """At the end of the job: True if nothing abandoned is still pending, the graveyard then
        emptied so that the groups can be torn down before the interpreter exits (a surviving group
        alive at exit can crash the process). Every rank waits for the others first
        (:meth:`barrier_before_teardown`); then the fabric waits up to ``pg_timeout_s`` for what is
        still pending and keeps what it cannot destroy safely (:meth:`Fabric.release_graveyard`)."""
        self.barrier_before_teardown()
        if self._fabric is None:
            return not self.graveyard
        return self._fabric.release_graveyard(self._cfg.worker.pg_timeout_s)

    # -- the two sides ----------------------------------------------------------------------
    def survive(self, step: int, phase: str, *, cut_in_tail: bool = False, cut: ReductionCut | None = None) -> int:
        """A survivor's side, at ``step`` in ``phase`` (its step already dropped; ``cut_in_tail``: cut
        inside a reduction after the step's update, which the script changes state after; ``cut``: cut
        inside the reduction of a vote-less step, with its own state there); returns the step to resume at."""
        started = time.monotonic()
        self.fault_noted = False
        wrappers.reset_after_abort(self._tracked.objects.values())  # e.g. FSDP2 cut mid-forward: reshard
        if cut is not None and cut.state is not None and (why := self.votes.why_voting()) is not None:
            cut = ReductionCut(None, why)  # (seen since the generation's last vote)
        self._paused_step, self.pause_phase, self._cut_in_tail, self._cut = step, phase, cut_in_tail, cut
        control = self._control
        reported = control.abort_gen
        if self.damaged is not None and self._held is None:  # rung `retry`: its state comes from replicas
            control.damaged(str(self.damaged), self.damaged.kind)
            self.damaged, self.needs_state, self._keeps_own = None, True, True
        elif self._held is None:  # (paused in the commit vote, it announced itself then)
            self._announce(reported)
        return self._transfer_until_done(started, self._await_order(reported, adopt=False))

    def await_group(self) -> None:
        """A replacement, inside ``unbroken.init()``: wait for the regroup order and join its group.

        Joining before ``init()`` returns lets the training script build its model and
        optimizer on a process group of the right size; the state arrives in :meth:`join`.
        """
        self._order = self._await_order(self._control.abort_gen)
        if self._fabric is not None:  # the script's wrappers are built next: their collectives stay local
            self._fabric.hold()
        self._joined_t = time.monotonic()  # the script's own work up to job.steps() starts now

    def join(self) -> int:
        """A replacement's side, in ``job.steps()``: receive the state; returns the step to resume at."""
        order, self._order = self._order, None
        if self._fabric is not None:
            self._fabric.release()
        now = time.monotonic()
        script_s = now - self._joined_t if self._joined_t is not None else None
        return self._transfer_until_done(now, order, script_s=script_s)

    # -- the regroup ----------------------------------------------------------------------
    def _adopt_group(self, gen: int) -> None:
        if self._fabric is not None:  # every surviving group moves; the old backends go to the graveyard
            self._fabric.switch(gen)
            self.gen, self.group = gen, self._fabric.world.backend
            if self.should_abort():  # an abort order came while switching: switch() cleared the signal
                self._fabric.signal.fire(self._control.abort_reason or f"abort order for generation {gen}")
            return
        group = generation_group(self._store, gen, rank=self._cfg.rank, world_size=self._cfg.world_size,
                                 timeout_s=self._cfg.worker.pg_timeout_s, device=self._device,
                                 lazy_connect=self._cfg.worker.lazy_connect)
        if self.group is not None:
            self.graveyard.append(self.group)  # never destroyed early: see FACTS.md
        self.gen, self.group = gen, group

    def _prepare_group(self, gen: int) -> None:
        """A survivor paused for generation ``gen``'s order: build that generation's groups now
        (Fabric.prepare, lazy connections only), after the report the order waits for, so that
        after the order it needs no CPU for them. Best effort."""
        if self._fabric is None or gen <= self.gen:
            return
        try:
            self._fabric.prepare(gen)
        except Exception as exc:  # noqa: BLE001 - the switch builds them after the order instead
            log.debug("rank %d: groups not built ahead: %s", self._cfg.rank, exc)

    def _announce(self, gen: int) -> None:
        """Tell the controller this rank is ready for generation ``gen``."""
        if self.needs_state:
            self._control.joined(gen)
        else:
            cut = self._cut
            self._control.paused(gen, self._paused_step, self.pause_phase, cut_in_tail=self._cut_in_tail,
                                 cut_in_reduction=cut is not None, cut_unsure=cut.why_unsure if cut else "")
            self._prepare_group(gen)

    def _await_order(self, reported: int, *, adopt: bool = True) -> Regroup:  # a Dump order is carried out inside
        """The next regroup order; with ``adopt`` its group is joined at once (a replacement, in
        ``init()``), otherwise in :meth:`_transfer` (a survivor in no move joins after the movers)."""
        order, self._held = self._held, None
        if order is not None and order.gen < self._control.abort_gen:  # a newer abort replaced the held order
            order, reported = None, self._control.abort_gen
            self._announce(reported)
        order = order or self._next_order(reported)
        if isinstance(order, Dump):
            self._dump(order)  # then wait: the agent stops this process for the job restart
            return self._await_order(self._control.abort_gen, adopt=adopt)
        if adopt:
            self._adopt_group(order.gen)
        return order

    def _next_order(self, reported: int) -> Regroup | Dump:
        """The controller's next order (announcing this rank again on each newer abort); JobFailed
        when none comes within --recovery-timeout-s."""
        timeout_s = self._cfg.worker.recovery_timeout_s
        order = self._control.wait_regroup(timeout_s, self._announce, reported)
        if order is None:
            raise JobFailed(f"rank {self._cfg.rank}: no regroup order from the controller within "
                            f"{timeout_s:.0f} s (--recovery-timeout-s); giving up")
        return order

    def _dump(self, order: Dump) -> None:
        """Rung `dump`: write this rank's state, and that of the lost ranks it holds replicas of,
        to storage at the decided step. No collective when ranks were lost: every survivor writes
        on its own. When nobody was lost (a sub-health dump), every rank first joins the order's
        generation to complete a step whose parameter gather the abort cut."""
        rank = self._cfg.rank
        ranks = [rank] + [lost for lost, writer in order.assign if writer == rank]
        error = ""
        try:
            self._dump_target.check_dump()
            if not order.assign:
                self._adopt_group(order.gen)
                self._recover_recoverable(())
            if self._tracked.step_pending():
                raise CheckpointError("a parameter gather was cut: this rank holds no consistent copy")
            self._injector.at(order.step, Phase.CHECKPOINT)  # a fault planned for the dump fires here
            self._dump_target.write_dump(order.step, ranks, order.states)
        except Exception as exc:  # noqa: BLE001 - any failure is reported; the ladder goes on to `exit`
            if not isinstance(exc, (CheckpointError, OSError)) and not self.is_recoverable(exc):
                raise
            error = str(exc) or type(exc).__name__
            log.warning("rank %d: dump of step %d failed: %s", rank, order.step, error)
        self._control.dumped(order.step, ranks, error)

    def _transfer_until_done(self, started: float, order: Regroup, script_s: float | None = None) -> int:
        while True:
            regroup_t = time.monotonic()
            laps: dict[str, float] = {}
            try:
                if self.needs_state:
                    self._injector.at(order.resume_step, Phase.RESTORE)
                self._transfer(order, laps)
            except Exception as exc:  # a peer lost during the transfer: the next generation comes
                if not self.is_recoverable(exc):
                    raise
                log.warning("rank %d: transfer for generation %d aborted (%s); waiting for the next one",
                            self._cfg.rank, order.gen, exc)
                reported = self._control.abort_gen
                self._announce(reported)
                order = self._await_order(reported, adopt=False)
                continue
            restore_s = time.monotonic() - regroup_t
            role = "repaired" if self._keeps_own else "replacement" if self.needs_state else \
                "behind" if self._cfg.rank in order.behind else "survivor"
            self.needs_state = self._keeps_own = False
            self._cut = None
            self._control.resumed(order.gen, order.resume_step, restore_s,
                                  _restore_phases(order.gen, role, restore_s, script_s, laps))
            log.info("rank %d: resumed at step %d in generation %d after %.3f s (restore %.3f s)",
                     self._cfg.rank, order.resume_step, order.gen, time.monotonic() - started, restore_s)
            return order.resume_step

    def _recover_recoverable(self, replaced: set[int] | tuple[()]) -> None:
        """Each recoverable object (e.g. a sharded optimizer) rebuilds itself from live holders, a
        collective on its own group. On the world group it moves to the new generation's; on a
        sub-group of the fabric (a mesh's dp group: the same SurvivingGroup object, already moved
        by the switch) it stays, and learns the replaced ranks as ranks of that group."""
        for obj in self._tracked.recoverable():
            group = getattr(obj, "process_group", None)
            if self._fabric is not None and isinstance(group, SurvivingGroup) and group is not self._fabric.world:
                obj.recover({group.global_ranks.index(r) for r in replaced if r in group.global_ranks})
                continue
            obj.set_process_group(self.group)
            obj.recover(replaced)

    def _transfer(self, order: Regroup, laps: dict[str, float]) -> None:
        """The transfer every rank runs after a regroup, from the same plan everywhere: recoverable
        state first (its own collectives), then each replicated plain object, and the per-rank
        state of ranks in ``fallback``, point to point from one live holder each (spread over
        the survivors, in parallel) to the replaced ranks; a survivor in no move does nothing, and
        with lazily connected groups it builds its group only once the movers are done (comm/movers.py)."""
        rank, replaced = self._cfg.rank, set(order.replaced)
        receivers = replaced | set(order.behind)  # the survivors behind take the replicated state too
        alive = [r for r in range(self._cfg.world_size) if r not in receivers]
        receiving = rank in replaced and not self._keeps_own
        if self.replica_map is None:  # every rank holds each object, or FSDP2's shard classes
            plain, holders, needs = self._plain_pieces(receivers, alive)
            moves, names = plan_moves(list(plain), holders, needs, alive), {key: key for key in plain}
        else:  # a mesh (job.mesh): a replaced rank gets its own stage's / shard's copy
            plain = dict(self._tracked.plain())
            moves, names = object_moves(list(plain), self.replica_map, receivers, alive)
        # The controller kept no per-rank state for the ranks in `fallback`: the lowest survivor's copy.
        moves += [Move(_PER_RANK, alive[0], r) for r in sorted(set(order.fallback) & replaced)]
        moving = involved(moves, rank)
        if self.gen < order.gen:  # a survivor: its group of this generation is built now
            if moves and not moving and self._may_defer_group():
                t = time.monotonic()
                movers.wait_done(self._store, order.gen, movers_in(moves), aborted=lambda: self._control.abort_gen > order.gen,
                                 timeout_s=self._cfg.worker.recovery_timeout_s)
                laps["deferred_s"] = time.monotonic() - t
            self._adopt_group(order.gen)
        t = time.monotonic()
        self._recover_recoverable(replaced)
        laps["recoverable_s"] = time.monotonic() - t

        def state_of(key: str) -> Any:
            return self._tracked.per_rank_tree() if key == _PER_RANK else self._tracked.state_of(plain[names[key]])

        def local_of(key: str) -> Any:  # a replacement's own tensors (its model as built) take the data
            return None if key == _PER_RANK else self._tracked.state_of(plain[names[key]])

        exchange: dict[str, float] = {}
        t = time.monotonic()
        got = exchange_states(moves, self.group, state_of=state_of, local_of=local_of, device=self._device,
                              should_abort=self.should_abort, graveyard=self.graveyard,
                              what=f"state transfer of generation {order.gen}", timings=exchange)
        laps["exchange_s"] = time.monotonic() - t
        laps.update({f"x_{k}": v for k, v in exchange.items()})
        t = time.monotonic()
        for key, name in names.items():
            if key in got:
                self._tracked.load_one(plain[name], got[key])
        if receiving and _PER_RANK in got:
            self._tracked.load_per_rank(got[_PER_RANK])
        elif receiving:
            self._tracked.load_per_rank(decode_tree(order.rank_state, f"rank {rank}'s per-rank state of step "
                                                                      f"{order.resume_step} from the controller"))
        elif rank in order.behind:  # its own state at the cut: its state after the compute of the step
            if self._cut is None or self._cut.state is None:
                raise JobFailed(f"rank {rank}: ordered to resume at step {order.resume_step} from its own state "
                                "inside the reduction, which it did not report exact")
            self._tracked.load_per_rank(decode_tree(self._cut.state, f"rank {rank}'s own state at its cut"))
        laps["load_s"] = time.monotonic() - t
        if moving:
            movers.mark_done(self._store, order.gen, rank)
        t = time.monotonic()
        self._realign_wrappers()
        laps["realign_s"] = time.monotonic() - t

    def _may_defer_group(self) -> bool:
        """Whether a survivor in no move may build its group after the movers (comm/movers.py):
        only where building it waits for no peer (lazily connected gloo groups; a full mesh connects
        every pair at the build) and no recoverable object needs it for a collective of its own."""
        return self._cfg.worker.lazy_connect and self._device.type != "cuda" and not self._tracked.recoverable()

    def _plain_pieces(self, replaced: set[int], alive: list[int]
                      ) -> tuple[dict[str, Any], dict[str, list[int]], dict[str, list[int]]]:
        """The replicated plain objects as transfer pieces: ``({key: object}, holders, needs)``.

        An object replicated whole is one piece that every rank holds. A sharded one (FSDP2's
        DTensors) is one piece per class of identical local shards (HSDP: a shard coordinate),
        held by that class's ranks and needed by the replaced ranks in it; a rank receives only
        its own class's piece (same plan on every rank: the mesh is the same everywhere)."""
        world = self._cfg.world_size
        plain, holders, needs = {}, {}, {}
        for name, obj in self._tracked.plain():
            classes = self._tracked.shard_classes(obj, world)
            if classes is None:
                key = f"object {name!r}"
                plain[key], holders[key], needs[key] = obj, alive, sorted(replaced)
                continue
            for n, ranks in enumerate(dtensor_state.holders_by_class(classes).values()):
                key = f"object {name!r} shard class {n}"
                plain[key], holders[key], needs[key] = obj, ranks, sorted(replaced & set(ranks))
        return plain, holders, needs

    def _realign_wrappers(self) -> None:
        """Every rank, last in the transfer: each surviving DDP's reducer reset and its buckets laid out
        as at track (parameter order), so every rank's buckets match the fault-free run's. Every DDP
        built on a surviving group, tracked or not (a fresh one would rebuild later than its peers)."""
        built = self._fabric.ddps.live() if self._fabric is not None else ()  # tracked or not
        for ddp in wrappers.surviving_ddps(self._tracked.objects.values(), built):
            ddp_generations.realign_buckets(ddp)
        for hook in self.after_transfer:  # e.g. the mesh's pipeline schedules warm up again at the redo
            hook()


def _restore_phases(gen: int, role: str, restore_s: float, script_s: float | None,
                    laps: dict[str, float]) -> dict[str, Any]:
    """Where this rank's restore time went, sent with its ``resumed`` report (the controller's event
    ``restore_phases``): seconds per sub-phase; ``script_s``: a replacement's own script between
    ``unbroken.init()`` and ``job.steps()``, which the survivors wait for inside their ``x_sends_s``;
    ``deferred_s``: a survivor in no move waiting for the movers (comm/movers.py)."""
    fields = {"gen": gen, "role": role, "restore_s": round(restore_s, 4), **{k: round(v, 4) for k, v in laps.items()}}
    if script_s is not None:
        fields["script_s"] = round(script_s, 4)
    return fields
