"""In-flight recovery inside a worker: pause, regroup, receive or send state, resume.

Both sides run in the training thread, inside :meth:`unbroken.worker.session.Job.steps`:

* a **survivor** left a step because its collective was aborted (the controller's
  abort order, or gloo reporting a dead peer). It drops what the step computed (gradients,
  RNG draws), reports itself paused, and waits for the regroup order;
* a **replacement** (a new process started for a lost rank) waits for the same order
  right after joining.

The order names the next generation, the step to resume at (the first uncommitted one,
see :mod:`unbroken.recovery.consistency`) and the replaced ranks. Every rank then builds
the generation's process group on a fresh store prefix and takes part in the same
sequence of collectives: sharded optimizers first restore their shards and parameters from
live holders, then every other tracked object and the RNG state go from the lowest
surviving rank to the replaced ones. A second fault meanwhile aborts the transfer and the
whole sequence starts again for the next generation.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from unbroken.errors import CheckpointError, JobFailed
from unbroken.protocol.messages import Dump, Regroup
from unbroken.comm.transfer import broadcast_state
from unbroken.worker import rng as rng_state

if TYPE_CHECKING:
    from unbroken.worker.session import Job

log = logging.getLogger(__name__)


def new_group(job: Job, gen: int) -> dist.ProcessGroup:
    """The process group of generation ``gen``: same ranks, a fresh prefix on the job's store."""
    store = dist.PrefixStore(f"gen{gen}/", job._store)
    timeout = timedelta(seconds=job.cfg.pg_timeout_s)
    if job.device.type == "cuda":  # pragma: no cover - needs a GPU
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, job.rank, job.world_size, opts)
    return dist.ProcessGroupGloo(store, job.rank, job.world_size, timeout)


def survive(job: Job) -> int:
    """A survivor's side; returns the step to resume at."""
    started = time.monotonic()
    job._pause_phase = job._phase if job._in_step else "compute"  # between steps: the next one's start
    job._drop_step_in_flight()
    control = job._control
    reported = control.abort_gen
    if job._damaged is not None:  # rung `retry`: this process stays; its state comes from replicas
        control.damaged(str(job._damaged), job._damaged.kind)
        job._damaged, job._needs_state = None, True
        return _transfer_until_done(job, started, _await_order(job, reported))
    control.paused(reported, job.step_index, job._pause_phase)
    return _transfer_until_done(job, started, _await_order(job, reported))


def await_group(job: Job) -> Regroup:
    """A replacement, inside ``unbroken.init()``: wait for the regroup order and join its group.

    Joining before ``init()`` returns lets the training script build its model and
    optimizer on a process group of the right size; the state arrives in ``job.steps()``.
    """
    return _await_order(job, job._control.abort_gen)


def join(job: Job, order: Regroup) -> int:
    """A replacement's side, in ``job.steps()``: receive the state; returns the step to resume at."""
    return _transfer_until_done(job, time.monotonic(), order)


def _announce(job: Job, gen: int) -> None:
    """Tell the controller this rank is ready for generation ``gen``."""
    if job._needs_state:
        job._control.joined(gen)
    else:
        job._control.paused(gen, job.step_index, job._pause_phase)


def _await_order(job: Job, reported: int) -> Regroup:  # a Dump order is carried out inside
    order = job._control.wait_regroup(job.cfg.recovery_timeout_s, lambda gen: _announce(job, gen), reported)
    if order is None:
        raise JobFailed(f"rank {job.rank}: no regroup order from the controller within "
                        f"{job.cfg.recovery_timeout_s:.0f} s (--recovery-timeout-s); giving up")
    if isinstance(order, Dump):
        _dump(job, order)  # then wait: the agent stops this process for the job restart
        return _await_order(job, job._control.abort_gen)
    job._adopt_group(order.gen, new_group(job, order.gen))
    return order


def _dump(job: Job, order: Dump) -> None:
    """Rung `dump`: write this rank's state, and that of the lost ranks it holds replicas of,
    to storage at the decided step. No collective when ranks were lost: every survivor writes
    on its own. When nobody was lost (a sub-health dump), every rank first joins the order's
    generation to complete a parameter gather the abort cut."""
    ranks = [job.rank] + [lost for lost, writer in order.assign if writer == job.rank]
    error = ""
    try:
        if job._storage is None or job.cfg.checkpoint.save_dir is None:
            raise CheckpointError("no storage tier (--save DIR) to dump to")
        if not order.assign:
            _complete_cut_gathers(job, order.gen)
        if job._gather_cut():
            raise CheckpointError("a parameter gather was cut: this rank holds no consistent copy")
        job._injector.at(order.step, "checkpoint")  # a fault planned for the dump fires here
        state = job._state()
        for rank in ranks:  # a replica's state is the lost rank's state, bit for bit
            job._storage.save_rank(order.step, rank, job.world_size, state, {"step": order.step, "dump": True})
    except Exception as exc:  # noqa: BLE001 - any failure is reported; the ladder goes on to `exit`
        if not isinstance(exc, (CheckpointError, OSError)) and not job._is_recoverable(exc):
            raise
        error = str(exc) or type(exc).__name__
        log.warning("rank %d: dump of step %d failed: %s", job.rank, order.step, error)
    job._control.dumped(order.step, ranks, error)


def _complete_cut_gathers(job: Job, gen: int) -> None:
    """Every rank, on generation ``gen``'s group: sharded optimizers complete the step whose
    parameter gather an abort cut (a collective, so every rank runs it)."""
    job._adopt_group(gen, new_group(job, gen))
    for obj in job._tracked.values():
        if hasattr(obj, "recover"):
            obj.set_process_group(job.process_group)
            obj.recover(())


def _transfer_until_done(job: Job, started: float, order: Regroup) -> int:
    control = job._control
    while True:
        regroup_t = time.monotonic()
        try:
            if job._needs_state:
                job._injector.at(order.resume_step, "restore")
            _transfer(job, set(order.replaced))
        except Exception as exc:  # a peer lost during the transfer: the next generation comes
            if not job._is_recoverable(exc):
                raise
            log.warning("rank %d: transfer for generation %d aborted (%s); waiting for the next one",
                        job.rank, order.gen, exc)
            reported = control.abort_gen
            _announce(job, reported)
            order = _await_order(job, reported)
            continue
        restore_s = time.monotonic() - regroup_t
        job._step, job._needs_state = order.resume_step, False
        control.resumed(order.gen, order.resume_step, restore_s)
        log.info("rank %d: resumed at step %d in generation %d after %.3f s (restore %.3f s)",
                 job.rank, order.resume_step, order.gen, time.monotonic() - started, restore_s)
        return order.resume_step


def _transfer(job: Job, replaced: set[int]) -> None:
    """The collective sequence every rank runs after a regroup (same order everywhere)."""
    group = job.process_group
    alive = [r for r in range(job.world_size) if r not in replaced]
    src = alive[0]
    receiving = job.rank in replaced
    common: dict[str, Any] = dict(device=job.device, should_abort=job._should_abort,
                                  graveyard=job._graveyard)
    for obj in job._tracked.values():
        if hasattr(obj, "recover"):  # a sharded optimizer restores its shards from their holders
            obj.set_process_group(group)
            obj.recover(replaced)
    for name, obj in job._tracked.items():
        if hasattr(obj, "recover"):
            continue
        state = (obj if isinstance(obj, torch.Tensor) else obj.state_dict()) if job.rank == src else None
        got = broadcast_state(state, src, group, what=f"transfer of {name!r} from rank {src}", **common)
        if receiving:
            job._load_tracked(name, obj, got)
    # The RNG streams are replicated state (every rank seeds them the same): the replaced
    # ranks continue the source's stream from the start of the step to redo.
    rng = broadcast_state(job._rng_at_step_start() if job.rank == src else None, src, group,
                          what=f"transfer of the RNG state from rank {src}", **common)
    if receiving:
        rng_state.restore(rng)
