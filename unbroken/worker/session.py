"""The worker session: what a training script sees of unbroken.

A :class:`Job` lives in one training process (one rank) and runs in its main thread. It
joins the job (process group, controller link), knows which objects are training state
(:meth:`Job.track`), resumes the loop at the right step (:meth:`Job.steps`), marks the
fault boundary of each step (:meth:`Job.step`), reports step and phase and fires injected
faults. It delegates, each piece owning its own state: the tracked objects (``TrackedState``),
the step in flight and what runs at its boundaries: capture, phases, commit wait, reports
(``StepBoundary``), in-flight recovery with the groups of the current generation (``InFlight``),
checkpoint writing (``Checkpointer``) and the restore at a (re)start (:func:`unbroken.worker.restore.restore`).

Phases of a step, in order: ``compute`` -> ``sync`` -> ``update`` -> ``done`` (the optimizer,
``job.all_reduce`` or a DDP's all-reduce report ``sync``/``update``/``done``).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import sys
import time
from types import FrameType
from typing import Any, Iterable, Iterator, NoReturn

import torch
import torch.distributed as dist

from unbroken.checkpoint.own_state import OwnStateWriter
from unbroken.checkpoint.shm_files import own_state_path
from unbroken.comm import wait_all
from unbroken.errors import EXIT_FATAL, CheckpointError, ConfigError, FatalError
from unbroken.faults.inject import FaultInjector, file_claim
from unbroken.faults.plan import parse_plan, validate_plan
from unbroken.names import Phase
from unbroken.worker.data_share import DataShare, sum_in_data_rank_order
from unbroken.worker import first_group, integrity, meshes, restore, script_imports, untracked, wrappers
from unbroken.worker.api import SessionHooks
from unbroken.worker.checkpointing import Checkpointer
from unbroken.worker.control import ControlClient
from unbroken.worker.inflight import InFlight
from unbroken.worker.step_boundary import StepBoundary
from unbroken.worker.tracked import TrackedState, name_list
from unbroken.worker_config import WorkerConfig

log = logging.getLogger(__name__)


def _default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class Job:
    """One rank's session of a training job. Create it with :func:`unbroken.init`.

    Lives in the training thread of one process. Owns the step loop, the controller link and
    the fault injector; see the module docstring for what it delegates.
    """

    def __init__(self, cfg: WorkerConfig, *, device: torch.device | None = None,
                 backend: str | None = None) -> None:
        self.cfg = cfg
        self.rank, self.world_size, self.local_rank, self.attempt = cfg.rank, cfg.world_size, cfg.local_rank, cfg.attempt
        self.device = device or self._build_device()
        self._tracked, self._metrics = TrackedState(), {}  # the tracked objects; this step's progress metrics
        self._restored = False
        self._not_state: set[str] = set()  # job.track(not_state=...): variables the untracked-state check skips
        self._raised_in_step = False  # an exception left `with job.step():`: the loop crashed, it did not finish
        self._mesh: meshes.JobMesh | None = None  # job.mesh()
        self._control = self._build_control()
        script_imports.report(self._control, cfg)  # for the warm spares: what the script imported
        self._injector = self._build_injector()
        self._own_state = self._build_own_state()
        self._ckpt = Checkpointer(cfg, managed=self._control is not None, tracked=self._tracked,
                                  injector=self._injector, all_min=self._all_min, event=self._event,
                                  metrics=self._metrics)
        self._boundary = StepBoundary(
            self.rank, finite_check=cfg.worker.finite_check, control=lambda: self._control,
            generation=lambda: self._inflight.gen, commit=lambda step, joined: self._inflight.commit(step, joined),
            voteless=lambda step: self._inflight.voteless(step),
            tracked=self._tracked, injector=self._injector, ckpt=self._ckpt, ready_fields=self._ready_fields,
            metrics=self._metrics, own_state=self._own_state)
        self._data_share = DataShare(cfg)
        backend = backend or _default_backend(self.device)
        start = first_group.build(cfg, backend, self.device,  # DDP's all-reduce marks 'sync':
                                  before_reduce=functools.partial(self._boundary.advance, Phase.SYNC),
                                  on_collective=self._boundary.waiting)
        self._owns_default_group, self._fabric = start.owns_default_group, start.fabric
        self._inflight = InFlight(cfg, device=self.device, control=self._control, store=start.store,
                                  group=start.group, tracked=self._tracked, injector=self._injector,
                                  dump=self._ckpt, fabric=self._fabric)
        if self._inflight.needs_state:
            # A replacement joins the next generation's group now, so the script builds its
            # model and optimizer on a group of the right size; its state comes in steps().
            self._inflight.await_group()

    # -- construction -----------------------------------------------------------------
    def _build_own_state(self) -> OwnStateWriter | None:
        """Under `unbroken run`, where the node has a memory directory: the file of this rank's own state
        that its agent sends on if the process dies (checkpoint/own_state.py)."""
        shm = self.cfg.checkpoint.shm_dir
        if self._control is None or not self.cfg.job_id or not os.path.isdir(shm):
            return None
        if self.cfg.local_world_size < self.cfg.world_size and not self.cfg.worker.node_summaries:
            # A lost node takes the file with it: the commit reports go on carrying the state (a copy on a peer
            # node would lift this). Under node summaries a lost node's ranks restart anyway (agent/held_reports.py).
            return None
        try:
            return OwnStateWriter(own_state_path(shm, self.cfg.job_id, self.rank))
        except (OSError, CheckpointError) as exc:
            log.warning("rank %d: no file for its own state in %s (%s): a fault between a peer's update and this "
                        "rank's commit report is then recovered by a restart", self.rank, shm, exc)
            return None

    def _build_device(self) -> torch.device:
        if torch.cuda.is_available():
            torch.cuda.set_device(self.local_rank)
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    def _build_control(self) -> ControlClient | None:
        if (cfg := self.cfg).mode != "managed":
            return None
        return ControlClient(cfg.controller, cfg.secret, rank=self.rank, pid=os.getpid(), attempt=self.attempt,
                             gen=cfg.gen, replacement=cfg.replacement, relay=cfg.relay)

    def _build_injector(self) -> FaultInjector:
        faults = parse_plan(self.cfg.inject)
        validate_plan(faults, self.world_size)
        if self._control is not None:
            claim = lambda fault, control=self._control: control.claim_fault(fault.fault_id)  # noqa: E731
        else:
            claim = file_claim(self.cfg.run_dir)
        # A memory fault damages the live state: the pending snapshot's copy of it completes first.
        return FaultInjector(faults, self.rank, claim, tracked=lambda: (self._ckpt.settle(), self._tracked.objects)[1],
                             degraded=self.report_degraded)

    # -- the training-loop API ---------------------------------------------------------
    def track(self, *, per_rank: Iterable[str] = (), replicated: Iterable[str] = (), not_state: Iterable[str] = (),
              **objects: Any) -> None:
        """Declare training state: objects with ``state_dict``/``load_state_dict``, or tensors.

        Replicated or per rank: see :mod:`unbroken.worker.tracked`; ``per_rank``/``replicated``
        name tracked objects whose class differs from the default. Recoverable objects
        (:class:`unbroken.worker.api.RecoverableState`) are wired to this session. ``not_state``:
        names of the script's variables that its steps change but that are not training state
        (a metric for logging): the first step's check for untracked state leaves them alone
        (:mod:`unbroken.worker.untracked`)."""
        hooks = SessionHooks(on_phase=self._boundary.on_optimizer_phase, should_abort=self._inflight.should_abort,
                             defer_completion=self.cfg.mode == "managed", fail=self._exit_if_fatal)
        with self._fatal_exits():
            for name, obj in objects.items():
                if obj is not None:
                    self._tracked.add(name, obj, hooks)
                    wrappers.prepare(obj, functools.partial(self._boundary.advance, Phase.UPDATE))
            self._tracked.classify(per_rank, replicated)
            self._not_state |= name_list("not_state", not_state)

    def mesh(self, *dims: tuple[str, int], replicate: str = "dp") -> meshes.JobMesh:
        """The job's mesh, e.g. ``job.mesh(("pp", 2), ("dp", 2), ("tp", 1))``: see unbroken.worker.meshes."""
        with self._fatal_exits():
            self._mesh = meshes.attach(self._mesh, dims, replicate, self._tracked.frozen, self.cfg, self.device,
                                       self._fabric, self._inflight)
        return self._mesh

    def steps(self, total: int) -> Iterator[int]:
        """Yield step indices from where the job resumes up to ``total`` (exclusive).

        After an in-flight recovery the same index may come again: the step is redone. Before
        the first step, the memory tier is checked to fit in its shm dir (ShmCapacityError).
        """
        loop_frame = sys._getframe(1)  # the script's loop: what it names is checked after the first step
        with self._fatal_exits():
            yield from self._steps(total, loop_frame)

    def _steps(self, total: int, loop_frame: FrameType | None = None) -> Iterator[int]:
        if total < 0:
            raise ConfigError(f"job.steps(total): total must be >= 0, got {total}")
        boundary, self._raised_in_step = self._boundary, False  # (a loop begun again after a caught crash)
        if self._fabric is not None:  # DDPs on the default group the script did not track itself
            wrappers.prepare_untracked_ddps(self._fabric.ddps.live(), self._tracked, self.rank)
        boundary.step = self._inflight.join() if self._inflight.needs_state else self._restore()
        self._restored = self._tracked.frozen = True
        self._ckpt.check_capacity(boundary.step)
        watch = (untracked.FirstStepWatch(loop_frame, self._tracked.covered_ids(), self._not_state,
                                          self._tracked.objects, self._tracked.covered_ids)
                 if self._control is not None else None)  # only where a fault is recovered from
        del loop_frame
        while boundary.step < total:
            if self._control is not None and self._inflight.pending:
                boundary.step = self._survive()
                continue
            index = boundary.step
            boundary.begin()
            try:
                self.phase(Phase.COMPUTE)  # faults planned for 'compute' fire here, as the step starts
            except Exception as exc:
                if not self._inflight.note_fault(index, exc):
                    raise
                continue
            try:
                yield index
            except GeneratorExit:  # the script left the loop early (`break`): no more step progress,
                if not self._raised_in_step:  # unless a step's exception left it (a crash, not an end)
                    self._report_finished()
                raise
            if self._inflight.fault_noted:
                continue
            if boundary.step == index:  # the loop body did not use `with job.step():`
                boundary.end(index)
            try:
                ckpt_started = time.monotonic()
                self._check_replicas()
                self._ckpt.after_step(boundary.step)
                self._metrics["ckpt_s"] = time.monotonic() - ckpt_started  # the step's checkpoint stall
            except Exception as exc:  # a peer lost during the check or checkpoint, or an odd copy: recover
                if not self._inflight.note_fault(index, exc):
                    raise
                continue
            boundary.report_progress()
            if watch is not None:
                changed, watch = watch.changed(), None
                untracked.refuse_changed(changed, self.rank)
        self._report_finished()

    def _report_finished(self) -> None:  # past the loop: no step progress to expect any more
        self._ckpt.settle()  # the script may change its state from here on
        if self._control is not None:
            self._control.progress(self._boundary.step, Phase.FINISHED)

    @contextlib.contextmanager
    def step(self) -> Iterator[int]:
        """The fault boundary of one step (its phase ``compute`` began in :meth:`steps`).

        Under `unbroken run`, a collective aborted inside the step (a peer was lost) does
        not propagate: the step is dropped and :meth:`steps` recovers in flight and
        yields the step to redo. A FatalError ends the process with EXIT_FATAL there.
        """
        index = self._boundary.step
        try:
            yield index
        except Exception as exc:
            if not self._inflight.note_fault(index, exc):
                self._exit_if_fatal(exc)
                self._raised_in_step = True
                raise
            return
        with self._fatal_exits():  # (the first step's order checks: worker/step_boundary.py _check_order)
            self._boundary.end(index)

    @contextlib.contextmanager
    def _fatal_exits(self) -> Iterator[None]:
        """Under `unbroken run`, a FatalError leaving the block ends this worker with EXIT_FATAL."""
        try:
            yield
        except FatalError as exc:
            self._exit_if_fatal(exc)
            raise

    def _exit_if_fatal(self, exc: Exception) -> None:
        """Under `unbroken run`, for a FatalError: close the session, then exit with EXIT_FATAL, so the
        controller fails the job instead of restarting a worker that would fail again. Closing first matters:
        a gloo group alive at interpreter exit can abort the process, and the exit code with it. Elsewhere return."""
        if not isinstance(exc, FatalError) or self.cfg.mode != "managed":
            return
        if self._control is not None:  # the reason, in the job's event log
            self._control.event("fatal_error", {"error": f"{type(exc).__name__}: {exc}"})
        try:
            self.close()
        except Exception as close_exc:  # noqa: BLE001  (exiting anyway: keep the first error)
            log.warning("rank %d: closing the session before a fatal exit failed: %s", self.rank, close_exc)
        exit_fatal(exc, f"rank {self.rank}")

    def phase(self, name: str, step: int | None = None) -> None:
        """Record the phase of the step in flight; fires injected faults planned for it."""
        self._boundary.enter(name, step)

    # -- this rank's share of the global batch (rung elastic) -------------------------------
    @property
    def data_world_size(self) -> int:
        """How many data-parallel shards the global batch is split into: the world size, or the launch's
        world size after rung elastic shrank the job in exact mode. Average gradients over this, not
        ``world_size``."""
        return self._data_share.world_size

    def data_ranks(self) -> tuple[int, ...]:
        """The data-parallel shards (ranks of a world of :attr:`data_world_size`) this rank runs this step:
        ``(rank,)``, or more after rung elastic shrank the job in exact mode. Run one micro-batch per entry
        and accumulate the gradients; the global batch and the sample order stay the fault-free run's.
        A job whose every rank calls it in its steps may shrink exactly (``--elastic-mode exact``)."""
        return self._data_share.ranks()

    def sum_over_data_ranks(self, parts: dict[int, torch.Tensor]) -> torch.Tensor:
        """The job-wide sum of one tensor per data-parallel rank (``parts``: this rank's, keyed by the
        entries of :meth:`data_ranks`), added in data-rank order: bit for bit the same at any world size,
        unlike an all-reduce, whose order of additions follows the world. Use it for the gradients when a
        shrunk job (rung elastic, exact mode) must keep the fault-free run's bits."""
        return sum_in_data_rank_order(parts, self.data_world_size, self.world_size, self.all_gather)

    @property
    def lr_scale(self) -> float:
        """The factor for the learning rate ``--elastic-lr-scaling`` sets after the job shrank in fast
        mode (1.0 otherwise)."""
        return self.cfg.lr_scale

    def _ready_fields(self) -> dict[str, Any]:
        return dict(meshes.ready_fields(self._mesh, self._tracked, self.world_size),
                    not_exact=self._data_share.not_exact(self._tracked.objects, self._tracked.per_rank))

    # -- collectives that can be abandoned ----------------------------------------------
    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The job's process group, for a wrapper or a collective of the script (``DDP(model,
        process_group=job.process_group)``, ``ShardedOptimizer``, ``dist.all_reduce(..., group=...)``).

        Under `unbroken run` on CPU: the default group, a SurvivingGroup that moves to each new generation
        (a DDP built on it recovers in flight as ``DDP(model)`` does); elsewhere the default group."""
        return self._fabric.world if self._fabric is not None else self._inflight.group

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        """``dist.all_reduce`` on the current generation, abandoned promptly on an abort order."""
        self._boundary.advance(Phase.SYNC)
        if self.world_size > 1:
            work = dist.all_reduce(tensor, op=op, group=self._inflight.group, async_op=True)
            self._wait(work, f"all-reduce of step {self._boundary.step}")
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """``dist.all_gather`` of ``tensor`` on the current generation, abandoned promptly on an abort order."""
        self._boundary.advance(Phase.SYNC)
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        if self.world_size == 1:
            out[0].copy_(tensor)
            return out
        work = dist.all_gather(out, tensor, group=self._inflight.group, async_op=True)
        self._wait(work, f"all-gather of step {self._boundary.step}")
        return out

    def _wait(self, work: dist.Work, what: str) -> None:
        wait_all([work], self._inflight.should_abort if self._control else None, self._inflight.graveyard, what)

    def _check_replicas(self) -> None:
        """Every ``--sdc-check-every-steps`` steps: compare the replicated state across ranks."""
        every = self.cfg.worker.sdc_check_every_steps
        step = self._boundary.step
        if self._control is not None and every and not step % every:
            integrity.check_replicas(self._tracked.objects, rank=self.rank, world_size=self.world_size,
                                     step=step - 1, device=self.device, gather=self.all_gather)

    # -- the step in flight ---------------------------------------------------------------
    def _survive(self) -> int:
        """Drop the step in flight (gradients, what it changed before its commit), recover; the step to resume at."""
        boundary = self._boundary
        cut_in_tail, cut = boundary.cut_in_tail, boundary.reduction_cut()  # (before the drop: it ends the step)
        pause_phase = boundary.drop()
        return self._inflight.survive(boundary.step, pause_phase, cut_in_tail=cut_in_tail, cut=cut)

    # -- reports, checkpoints, the end ---------------------------------------------------
    def report_degraded(self, reason: str) -> None:
        """Report this rank degraded (sub-health: e.g. a device health monitor's warning). Under
        ``--sub-health-policy grace-exit`` the job dumps its state at once and restarts cleanly from it;
        under ``ignore`` (the default) the report is only logged."""
        log.warning("rank %d: reported degraded at step %d: %s", self.rank, self._boundary.step, reason)
        if self._control is not None:
            self._control.degraded(reason)

    def report(self, **metrics: Any) -> None:
        """Attach metrics (loss, ...) to this step's progress report (ignored after a dropped step)."""
        if not self._step_dropped("job.report"):
            self._metrics.update({k: v.item() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()})

    def checkpoint(self) -> None:
        """Checkpoint the state now (after the last completed step), to storage too; not after a dropped step."""
        if self._step_dropped("job.checkpoint"):
            return
        self._ckpt.checkpoint_now(self._boundary.step, in_step=self._boundary.in_step)

    @property
    def step_completed(self) -> bool:
        """True after the ``with job.step():`` block of a completed step; False while a step runs and
        after a dropped one (:meth:`steps` yields it again): guard post-block code with it."""
        return self._boundary.completed

    def _step_dropped(self, what: str) -> bool:
        if not self._inflight.fault_noted:
            return False
        log.debug("rank %d: %s after dropped step %d ignored (the step is redone)", self.rank, what,
                  self._boundary.step)
        return True

    @property
    def step_index(self) -> int:
        """The index of the step in flight (equals the number of completed steps)."""
        return self._boundary.step

    def close(self) -> None:
        """Leave the job: closes the controller link and the process group. Safe to call twice."""
        self._ckpt.close()  # waits for the last snapshot's commit
        if self._own_state is not None:
            self._own_state.close()
        if self._control is not None:
            self._control.close()
            self._control = None
        self._release_process_groups()

    def _release_process_groups(self) -> None:
        """Destroy the process groups now, not at interpreter exit, where a gloo group still
        alive can abort the process. Groups with abandoned work stay (FACTS.md: destroying
        them blocks until their timeout); a process exits cleanly with them."""
        if not self._owns_default_group or not dist.is_initialized():
            return
        if not self._inflight.release_graveyard() or self._tracked.has_abandoned_work():
            return
        for obj in self._tracked.recoverable():
            obj.release_process_groups()
        self._inflight.group = None
        first_group.destroy(self._fabric)
        gc.collect()  # the group objects go now, while the interpreter is whole

    def _event(self, name: str, **fields: Any) -> None:
        if self._control is not None:
            self._control.event(name, fields)

    def _all_min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def _restore(self) -> int:
        """Agree with every rank on the newest step all can load (restore.build_sources), load it; return the
        step. Under `unbroken run` the controller decides the step, elsewhere an all-reduce (see restore.py)."""
        if self._restored:
            return self._boundary.step
        self._restored = True
        sources = restore.build_sources(self.cfg, own_storage=self._ckpt.storage, control=self._control,
                                        all_min=self._all_min)
        return restore.restore(sources, self._tracked, self._event)


def exit_fatal(exc: FatalError, who: str) -> NoReturn:
    """Log `exc` and end this worker with EXIT_FATAL (SystemExit: `finally` blocks still run)."""
    log.error("%s: fatal error, exit code EXIT_FATAL=%d (not restarted): %s: %s", who, EXIT_FATAL,
              type(exc).__name__, exc)
    raise SystemExit(EXIT_FATAL) from exc
