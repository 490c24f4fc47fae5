"""The worker session: what a training script sees of unbroken.

A :class:`Job` lives in one training process (one rank) and runs in its main thread. It
joins the job (process group, controller link), knows which objects are training state
(:meth:`Job.track`), resumes the loop at the right step (:meth:`Job.steps`), marks the
fault boundary of each step (:meth:`Job.step`), reports step and phase, fires injected
faults, and writes and restores checkpoints (:mod:`unbroken.worker.checkpointing`,
:mod:`unbroken.worker.restore`).

Phases of a step, in order: ``compute`` -> ``sync`` -> ``update`` -> ``done`` (the
optimizer reports ``sync``/``update``/``done`` through :meth:`Job.phase`).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Iterator, NoReturn

import torch
import torch.distributed as dist

from unbroken.checkpoint.storage import StorageTier
from unbroken.config import WorkerConfig, managed_from_env, worker_config_from_env
from unbroken.errors import EXIT_FATAL, CheckpointError, CollectiveAborted, ConfigError, FatalError, StateDamaged
from unbroken.faults.inject import FaultInjector, file_claim
from unbroken.faults.plan import parse_plan, validate_plan
from unbroken.comm.wait import wait_all
from unbroken.worker import checkpointing, inflight, integrity, restore, rng
from unbroken.worker.control import ControlClient

if TYPE_CHECKING:
    from unbroken.checkpoint.memory import SnapshotWriter

log = logging.getLogger(__name__)

PHASES = ("compute", "sync", "update", "done")


def _default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class Job:
    """One rank's session of a training job. Create it with :func:`unbroken.init`."""

    def __init__(self, cfg: WorkerConfig, *, device: torch.device | None = None,
                 backend: str | None = None) -> None:
        self.cfg = cfg
        self.rank = cfg.rank
        self.world_size = cfg.world_size
        self.local_rank = cfg.local_rank
        self.attempt = cfg.attempt
        self.device = device or self._build_device()
        self._tracked: dict[str, Any] = {}
        self._metrics: dict[str, Any] = {}
        self._step = 0  # index of the step in flight (== number of completed steps)
        self._phase = "done"
        self._step_started = time.monotonic()
        self._last_step_s = 0.0
        self._restored = False
        self._warned_save_failure = False
        # In-flight recovery: the generation of the process group in use, groups and
        # collectives abandoned on an abort (kept referenced until they end, FACTS.md).
        self._gen = 0
        self._group: dist.ProcessGroup | None = None
        self._store: dist.Store | None = None
        self._graveyard: list[Any] = []
        self._in_step = False
        self._step_rng: dict[str, Any] | None = None
        self._recovery_needed = False
        self._committed_this_step = False
        self._announced_ready = False
        self._needs_state = cfg.replacement  # a replacement receives its state from replicas
        self._pause_phase = "compute"
        self._damaged: StateDamaged | None = None  # this rank's state is damaged: repair from replicas
        self._owns_default_group = False
        self._control = self._build_control()
        self._injector = self._build_injector()
        self._storage = self._build_storage()
        self._snapshots: SnapshotWriter | None = None  # the memory tier, built at the first snapshot
        self._memory_tier = self._control is not None and bool(cfg.job_id) and cfg.checkpoint.every_steps > 0
        self._build_process_group(backend or _default_backend(self.device))
        # A replacement joins the next generation's group now, so the script builds its
        # model and optimizer on a group of the right size; its state comes in steps().
        self._order = inflight.await_group(self) if self._needs_state else None

    # -- construction -----------------------------------------------------------------
    def _build_device(self) -> torch.device:
        if torch.cuda.is_available():
            torch.cuda.set_device(self.local_rank)
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    def _build_control(self) -> ControlClient | None:
        if self.cfg.mode != "managed":
            return None
        return ControlClient(self.cfg.controller, self.cfg.secret, rank=self.rank, pid=os.getpid(),
                             attempt=self.attempt, gen=self.cfg.gen, replacement=self.cfg.replacement)

    def _build_injector(self) -> FaultInjector:
        faults = parse_plan(self.cfg.inject)
        validate_plan(faults, self.world_size)
        if self._control is not None:
            control = self._control
            claim = lambda fault: control.claim_fault(fault.fault_id)  # noqa: E731
        else:
            claim = file_claim(self.cfg.run_dir)
        return FaultInjector(faults, self.rank, claim, tracked=lambda: self._tracked, degraded=self.report_degraded)

    def _build_storage(self) -> StorageTier | None:
        ckpt = self.cfg.checkpoint
        return StorageTier(ckpt.resume_dir, keep=ckpt.keep) if ckpt.resume_dir else None

    def _build_process_group(self, backend: str) -> None:
        timeout = timedelta(seconds=self.cfg.pg_timeout_s)
        if self.cfg.mode == "managed":
            # The store lives in the controller, one per attempt; generations get a prefix.
            self._store = dist.TCPStore(self.cfg.master_addr, self.cfg.master_port, world_size=self.world_size,
                                        is_master=False, timeout=timeout)
            if self.cfg.replacement:
                return  # joins the next generation's group when the regroup order comes
        if dist.is_initialized():  # the script built it: the script destroys it
            self._group = dist.group.WORLD
            return
        self._owns_default_group = True
        if self.cfg.mode == "managed":
            dist.init_process_group(backend, store=dist.PrefixStore("gen0/", self._store), rank=self.rank,
                                    world_size=self.world_size, timeout=timeout)
        elif self.cfg.mode == "torchrun":
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        self._group = dist.group.WORLD

    # -- the training-loop API ---------------------------------------------------------
    def track(self, **objects: Any) -> None:
        """Declare training state: objects with ``state_dict``/``load_state_dict``, or tensors.

        Optimizers that report phases (``on_phase`` attribute) are wired to this session.
        """
        with self._fatal_exits():
            self._track(objects)

    def _track(self, objects: dict[str, Any]) -> None:
        for name, obj in objects.items():
            if obj is None:
                continue
            if not isinstance(obj, torch.Tensor) and not (
                    hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ConfigError(f"job.track({name}=...): a {type(obj).__name__} has no state_dict/"
                                  "load_state_dict; track modules, optimizers, schedulers, samplers or tensors")
            if self._restored:
                raise ConfigError(f"job.track({name}=...) after job.steps() started: track all state first")
            self._tracked[name] = obj
            if hasattr(obj, "on_phase") and getattr(obj, "on_phase") is None:
                obj.on_phase = self._on_optimizer_phase
            if hasattr(obj, "should_abort") and getattr(obj, "should_abort") is None:
                obj.should_abort = self._should_abort
            if hasattr(obj, "defer_aborted_gather") and self.cfg.mode == "managed":
                obj.defer_aborted_gather = True  # a committed step completes during the regroup

    def steps(self, total: int) -> Iterator[int]:
        """Yield step indices from where the job resumes up to ``total`` (exclusive).

        After an in-flight recovery the same index may come again: the step is redone. Before
        the first step, the memory tier is checked to fit in its shm dir (ShmCapacityError).
        """
        with self._fatal_exits():
            yield from self._steps(total)

    def _steps(self, total: int) -> Iterator[int]:
        if total < 0:
            raise ConfigError(f"job.steps(total): total must be >= 0, got {total}")
        self._step = inflight.join(self, self._order) if self._needs_state else self._restore()
        self._restored = True
        if self._memory_tier:
            checkpointing.check_capacity(self)
        while self._step < total:
            if self._should_abort() or self._recovery_needed or self._gather_cut():
                self._recovery_needed = False
                self._step = inflight.survive(self)
                continue
            index = self._step
            self._step_started = time.monotonic()
            if self._control is not None:
                self._step_rng = rng.capture()  # to redo this step exactly if it is aborted
            self._in_step, self._committed_this_step = True, False
            try:
                self.phase("compute")  # faults planned for 'compute' fire here, as the step starts
            except Exception as exc:
                if not self._abort_step(index, exc):
                    raise
                continue
            yield index
            if self._recovery_needed:
                continue
            if self._step == index:  # the loop body did not use `with job.step():`
                self._end_step(index)
            try:
                self._check_replicas()
                checkpointing.after_step(self)
            except Exception as exc:  # a peer lost during the check or checkpoint, or an odd copy: recover
                if not self._abort_step(index, exc):
                    raise
                continue
            self._report_progress()
        if self._control is not None:  # past the loop: no step progress to expect any more
            self._control.progress(self._step, "finished", {})

    @contextlib.contextmanager
    def step(self) -> Iterator[int]:
        """The fault boundary of one step (its phase ``compute`` began in :meth:`steps`).

        Under `unbroken run`, a collective aborted inside the step (a peer was lost) does
        not propagate: the step is dropped and :meth:`steps` recovers in flight and
        yields the step to redo. A FatalError ends the process with EXIT_FATAL there.
        """
        index = self._step
        try:
            yield index
        except Exception as exc:
            if not self._abort_step(index, exc):
                self._exit_if_fatal(exc)
                raise
            return
        self._end_step(index)

    @contextlib.contextmanager
    def _fatal_exits(self) -> Iterator[None]:
        """Under `unbroken run`, a FatalError leaving the block ends this worker with EXIT_FATAL."""
        try:
            yield
        except FatalError as exc:
            self._exit_if_fatal(exc)
            raise

    def _exit_if_fatal(self, exc: Exception) -> None:
        """Under `unbroken run`, for a FatalError: close the session, then exit with EXIT_FATAL,
        so the controller fails the job instead of restarting a worker that would fail again.
        Closing first matters: a gloo group still alive at interpreter exit can abort the
        process, and the exit code with it. Elsewhere (plain python, torchrun) return."""
        if not isinstance(exc, FatalError) or self.cfg.mode != "managed":
            return
        if self._control is not None:  # the reason, in the job's event log
            self._control.event("fatal_error", {"error": f"{type(exc).__name__}: {exc}"})
        try:
            self.close()
        except Exception as close_exc:  # noqa: BLE001  (exiting anyway: keep the first error)
            log.warning("rank %d: closing the session before a fatal exit failed: %s", self.rank, close_exc)
        _exit_fatal(exc, f"rank {self.rank}")

    def _abort_step(self, index: int, exc: Exception) -> bool:
        """A fault inside step ``index``: drop the step and recover in flight (True), or not (False)."""
        if not self._is_recoverable(exc):
            return False
        if isinstance(exc, StateDamaged):
            self._damaged = exc  # rung `retry`: this rank's state comes from replicas
        log.warning("rank %d: step %d aborted (%s); recovering in flight", self.rank, index,
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        self._recovery_needed = True
        return True

    def _is_recoverable(self, exc: Exception) -> bool:
        """A collective that failed or was aborted because a peer was lost, or state damaged in
        memory, under a controller (which repairs both from replicas)."""
        if self._control is None:
            return False
        if isinstance(exc, (StateDamaged, CollectiveAborted)):
            return True
        notes = getattr(exc, "__notes__", ())
        return isinstance(exc, RuntimeError) and any(n.startswith("unbroken: during the") for n in notes)

    def phase(self, name: str, step: int | None = None) -> None:
        """Record the phase of the step in flight; fires injected faults planned for it."""
        if name not in PHASES and name != "checkpoint":
            raise ConfigError(f"unknown phase {name!r} (allowed: {', '.join(PHASES)}, checkpoint)")
        self._phase = name
        if self._control is not None:  # the controller's view of where each rank is
            self._control.progress(self._step, name, {})
        if name == "sync" and self._control is not None and self.cfg.finite_check:
            integrity.check_finite(self._tracked, self.rank, self._step)  # before the reduction spreads it
        if name == "update":  # the reduction is done: the step commits before anything changes
            self._commit()
        self._injector.at(self._step if step is None else step, name)

    def _on_optimizer_phase(self, name: str, step: int) -> None:
        if name != "done":  # 'done' is recorded at the end of the step by the boundary
            self.phase(name)

    def _commit(self) -> None:
        """Entering ``update``: the reduction is done; wait until the controller commits the step."""
        if self._control is None or self._committed_this_step:
            return
        if not self._control.wait_commit(self._gen, self._step):
            raise CollectiveAborted(f"rank {self.rank}: step {self._step} was not committed (abort order for "
                                    f"generation {self._control.abort_gen}: {self._control.abort_reason})")
        self._committed_this_step = True

    # -- collectives that can be abandoned ----------------------------------------------
    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The process group of the current generation (changes after an in-flight recovery)."""
        return self._group

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        """``dist.all_reduce`` on the current generation, abandoned promptly on an abort order."""
        if self.world_size > 1:
            work = dist.all_reduce(tensor, op=op, group=self._group, async_op=True)
            wait_all([work], self._should_abort if self._control else None, self._graveyard,
                     f"all-reduce of step {self._step}")
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """``dist.all_gather`` of ``tensor`` on the current generation, abandoned promptly on an abort order."""
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        if self.world_size == 1:
            out[0].copy_(tensor)
            return out
        work = dist.all_gather(out, tensor, group=self._group, async_op=True)
        wait_all([work], self._should_abort if self._control else None, self._graveyard,
                 f"all-gather of step {self._step}")
        return out

    def _check_replicas(self) -> None:
        """Every ``--sdc-check-every-steps`` steps: compare the replicated state across ranks."""
        every = self.cfg.sdc_check_every_steps
        if self._control is None or not every or self._step % every:
            return
        odd = integrity.check_replicas(self._tracked, rank=self.rank, world_size=self.world_size,
                                       step=self._step - 1, device=self.device,
                                       gather=self.all_gather)
        if odd:
            log.warning("rank %d: cross-replica check after step %d: ranks %s hold odd copies; they are "
                        "repaired from the majority", self.rank, self._step, odd)

    def _gather_cut(self) -> bool:
        """A tracked optimizer's parameter gather was cut by a fault (its step committed)."""
        return self._control is not None and any(getattr(o, "gather_pending", False) for o in self._tracked.values())

    def _should_abort(self) -> bool:
        return self._control is not None and self._control.abort_gen > self._gen

    def _adopt_group(self, gen: int, group: dist.ProcessGroup) -> None:
        if self._group is not None:
            self._graveyard.append(self._group)  # never destroyed early: see FACTS.md
        self._gen, self._group = gen, group

    def _drop_step_in_flight(self) -> None:
        """Forget what an aborted step computed: gradients and RNG draws."""
        for obj in self._tracked.values():
            if hasattr(obj, "zero_grad"):
                obj.zero_grad(set_to_none=True)
        if self._in_step and self._step_rng is not None:
            rng.restore(self._step_rng)
        self._in_step = False

    def _rng_at_step_start(self) -> dict[str, Any]:
        return self._step_rng if self._in_step and self._step_rng is not None else rng.capture()

    def _load_tracked(self, name: str, obj: Any, state: Any) -> None:
        if isinstance(obj, torch.Tensor):
            with torch.no_grad():
                obj.copy_(state)
        else:
            obj.load_state_dict(state)

    def _announce_ready(self) -> None:
        if self._control is None or self._announced_ready or not self._committed_this_step:
            return
        self._announced_ready = True
        replicas = [getattr(o, "num_replicas", 0) for o in self._tracked.values() if hasattr(o, "recover")]
        self._control.session_ready(min(replicas) if replicas else 0)

    def report_degraded(self, reason: str) -> None:
        """Report this rank degraded (sub-health: e.g. a device health monitor's warning).

        Under ``--sub-health-policy grace-exit`` the job dumps its state at once and restarts
        cleanly from it; under ``ignore`` (the default) the report is only logged.
        """
        log.warning("rank %d: reported degraded at step %d: %s", self.rank, self._step, reason)
        if self._control is not None:
            self._control.degraded(reason)

    def report(self, **metrics: Any) -> None:
        """Attach metrics (loss, ...) to this step's progress report."""
        for key, value in metrics.items():
            if isinstance(value, torch.Tensor):
                value = value.item()
            self._metrics[key] = value

    def checkpoint(self) -> None:
        """Checkpoint the state now (after the last completed step), to storage too."""
        checkpointing.checkpoint_now(self)

    @property
    def step_index(self) -> int:
        """The index of the step in flight (equals the number of completed steps)."""
        return self._step

    def close(self) -> None:
        """Leave the job: closes the controller link and the process group. Safe to call twice."""
        checkpointing.close(self)  # waits for the last snapshot's commit
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
        if self._graveyard or any(getattr(o, "abandoned_work", None) for o in self._tracked.values()):
            return
        for obj in self._tracked.values():
            if hasattr(obj, "release_process_groups"):
                obj.release_process_groups()
        self._group = None
        dist.destroy_process_group()
        gc.collect()  # the group objects go now, while the interpreter is whole

    # -- internals -----------------------------------------------------------------------
    def _end_step(self, index: int) -> None:
        self._phase = "done"
        self._in_step = False
        self._announce_ready()
        self._step = index + 1
        self._last_step_s = time.monotonic() - self._step_started

    def _report_progress(self) -> None:
        if self._control is not None:
            metrics = dict(self._metrics, step_s=self._last_step_s)
            self._control.progress(self._step, self._phase, metrics)

    def _event(self, name: str, **fields: Any) -> None:
        if self._control is not None:
            self._control.event(name, fields)

    def _state(self) -> dict[str, Any]:
        tracked = {name: (obj if isinstance(obj, torch.Tensor) else obj.state_dict())
                   for name, obj in self._tracked.items()}
        return {"tracked": tracked, "rng": rng.capture()}

    def _load_state(self, state: dict[str, Any]) -> None:
        tracked = state["tracked"]
        missing = sorted(set(self._tracked) - set(tracked))
        if missing:
            raise CheckpointError(f"checkpoint has no state for tracked object(s) {missing} "
                                  f"(it holds {sorted(tracked)})")
        for name, obj in self._tracked.items():
            self._load_tracked(name, obj, tracked[name])
        rng.restore(state["rng"])

    def _all_min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def _restore(self) -> int:
        """Agree with every rank on the newest step all can load, load it; return the step.

        Sources, fastest first: this node's shared-memory snapshots (a job-level restart of
        the same job), then the storage tier. Every rank must load the same step: under
        `unbroken run` the controller decides it, elsewhere an all-reduce (see restore.py).
        """
        if self._restored:
            return self._step
        self._restored = True
        return restore.restore(self)


def init(**overrides: Any) -> Job:
    """Join the job this process belongs to and return its session.

    Works under `unbroken run`, under plain `torchrun`, and in a plain ``python`` process
    (world size 1). Keyword arguments override the environment: ``save_dir``,
    ``load_dir``, ``every_steps``, ``keep``, ``run_dir``, ``inject``, ``pg_timeout_s``;
    ``device`` and ``backend`` choose the device and the process-group backend.

    Under `unbroken run`, a FatalError here (e.g. a ConfigError) and in ``job.track()``,
    ``job.steps()`` or a ``with job.step():`` block is logged at ERROR and ends the process
    with :data:`unbroken.EXIT_FATAL`: the job fails at once instead of restarting. Elsewhere
    it propagates as raised.
    """
    device = overrides.pop("device", None)
    backend = overrides.pop("backend", None)
    try:
        cfg: WorkerConfig = worker_config_from_env(**overrides)
        return Job(cfg, device=device, backend=backend)
    except FatalError as exc:
        if managed_from_env():
            _exit_fatal(exc, "worker")
        raise


def _exit_fatal(exc: FatalError, who: str) -> NoReturn:
    """Log `exc` and end this worker with EXIT_FATAL (SystemExit: `finally` blocks still run)."""
    log.error("%s: fatal error, exit code EXIT_FATAL=%d (not restarted): %s: %s", who, EXIT_FATAL,
              type(exc).__name__, exc)
    raise SystemExit(EXIT_FATAL) from exc
