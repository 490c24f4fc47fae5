"""What the session does to stock PyTorch objects when a script tracks them.

Called from :meth:`unbroken.worker.session.Job.track`, in the training thread of one rank,
once per tracked object:

* a **torch optimizer** (not a :class:`~unbroken.worker.api.RecoverableState`, which reports
  its phases itself) gets a step pre-hook: its ``step()`` is the first thing of a step that
  changes training state, so the hook enters phase ``update`` (the step commits first). The
  manual path (``job.all_reduce`` + a plain optimizer) then needs no ``job.phase`` calls.
* a **DistributedDataParallel** module gets its gradient buckets laid out now, in parameter
  order, as every later iteration uses them (see :func:`rebuild_ddp_buckets`), so that a job
  restarted from a checkpoint sums every gradient element exactly as the fault-free run did.
  A DDP on a SurvivingGroup that is not tracked itself (the script tracks the module inside it)
  gets the same layout before the first step (:func:`prepare_untracked_ddps`).

Which wrappers recover in flight (:func:`in_flight_blocker`): an FSDP2 module whose mesh was built
on the default group (its groups are then SurvivingGroups) with a replicate dimension first (HSDP;
without one, a lost rank's shards have no replica and the job restarts from a checkpoint), and
a DDP built on a :class:`~unbroken.parallel.group.SurvivingGroup` of a worker under `unbroken run`
on CPU: the default group (stock ``DistributedDataParallel(model)``, or
``process_group=job.process_group``, the same group) or a sub-group made after ``unbroken.init()``
(``dist.new_group()``). A DDP on any other group (a gloo group the script built with an explicit
``backend=``, a default group it initialised before ``unbroken.init()``, NCCL on a GPU) cannot be
moved to a new generation: such a job gets a bit-exact job restart instead, and the controller's
decision names the reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from unbroken.errors import ConfigError
from unbroken.parallel import dtensor_state
from unbroken.parallel import fsdp as fsdp_generations
from unbroken.parallel.group import SurvivingGroup
from unbroken.worker.api import RecoverableState
from unbroken.worker.tracked import TrackedState

log = logging.getLogger(__name__)

#: ``hook(optimizer, args, kwargs)``, torch's signature of an optimizer step pre-hook.
StepPreHook = Callable[[torch.optim.Optimizer, Any, Any], None]


def prepare(obj: Any, before_optimizer_step: StepPreHook) -> None:
    """Wire a tracked object to the session (see the module docstring); others are left alone."""
    if isinstance(obj, torch.optim.Optimizer) and not isinstance(obj, RecoverableState):
        obj.register_step_pre_hook(before_optimizer_step)
    elif isinstance(obj, DistributedDataParallel):
        rebuild_ddp_buckets(obj)


def rebuild_ddp_buckets(ddp: DistributedDataParallel) -> bool:
    """Lay out ``ddp``'s gradient buckets now, in parameter order; True if it was done.

    Why: DDP starts with one bucket layout and, after its first iteration, rebuilds its
    buckets in the order gradients became ready. gloo's sum of an element depends on the
    element's offset in its bucket, so a process restarted from a checkpoint (which runs
    its first step with the initial layout) reduces differently from the fault-free run,
    which is already on the rebuilt one: the weights drift. Forcing the rebuilt layout
    before the first step, in every process of every attempt, makes all of them use one
    layout. The cost: buckets in parameter order rather than backward order, so less
    overlap of the all-reduce with backward (on GPUs; docs/parallelism.md says so).

    A collective on DDP's process group (the bucket layout is broadcast from rank 0): every
    rank must track its DDP module at the same point, which ``job.track`` before the loop
    gives. Uses DDP's private reducer API (torch 2.x): feature-checked; where it is missing
    the module is left as it is, with a warning.
    """
    if getattr(ddp, "_has_rebuilt_buckets", True):
        return False  # already rebuilt (it has trained), or a DDP without the attribute
    reducer = getattr(ddp, "reducer", None)
    push = getattr(reducer, "_push_all_rebuilt_params", None)
    rebuild = getattr(reducer, "_rebuild_buckets", None)
    if push is None or rebuild is None:
        log.warning("this torch's DistributedDataParallel has no reducer._push_all_rebuilt_params/"
                    "_rebuild_buckets: its gradient buckets keep torch's layout, and a job restarted from a "
                    "checkpoint may not be bit-exact with the fault-free run")
        return False
    push()
    rebuilt = bool(rebuild())
    ddp._has_rebuilt_buckets = True  # DDP's forward would otherwise try to rebuild again
    return rebuilt


def surviving_ddps(objects: Iterable[Any], built: Iterable[DistributedDataParallel] = ()
                   ) -> list[DistributedDataParallel]:
    """The DDP modules that recover in flight: ``built`` (the fabric's record of every DDP built on a
    SurvivingGroup, tracked or not, in construction order), then any tracked one on a SurvivingGroup
    not in it."""
    out = list(built)
    out += [o for o in objects if isinstance(o, DistributedDataParallel) and isinstance(o.process_group, SurvivingGroup)
            and all(o is not d for d in out)]
    return out


def prepare_untracked_ddps(ddps: Iterable[DistributedDataParallel], tracked: TrackedState, rank: int) -> None:
    """Before the first step: each DDP built on a SurvivingGroup gets the bucket layout of a tracked DDP
    (:func:`rebuild_ddp_buckets`; nothing for one already laid out at ``job.track``), so a script that
    tracks the module inside its DDP (``job.track(model=net)``) recovers as one that tracks the DDP.
    A collective on each DDP's group, in construction order: every rank calls it at the same point.

    Raises ConfigError for a DDP whose parameters are not all held by tracked modules: a replaced rank
    would not receive them, and its weights would silently differ from the survivors'."""
    held = {id(p) for obj in tracked.objects.values() if isinstance(obj, torch.nn.Module) for p in obj.parameters()}
    for ddp in ddps:
        missing = sum(1 for p in ddp.parameters() if id(p) not in held)
        if missing:
            raise ConfigError(
                f"rank {rank}: a DistributedDataParallel({type(ddp.module).__name__}) has {missing} parameters "
                "that no tracked module holds, so a replaced rank would not get them: pass the DDP module (or the "
                "module inside it) to job.track(model=...) before job.steps()")
        rebuild_ddp_buckets(ddp)


def in_flight_blocker(tracked: TrackedState, world_size: int) -> str:
    """Why the tracked objects cannot be recovered in flight ("" when they can)."""
    for name, obj in tracked.objects.items():
        if isinstance(obj, DistributedDataParallel) and not isinstance(obj.process_group, SurvivingGroup):
            return ("it tracks a DistributedDataParallel module built on a process group unbroken cannot abort "
                    f"or move to a new generation ({type(obj.process_group).__name__}); under `unbroken run` on "
                    "CPU build it on the default group (no process_group argument) to recover it in flight")
        why = _sharded_blocker(name, obj, tracked, world_size)
        if why:
            return why
    return ""


def _sharded_blocker(name: str, obj: Any, tracked: TrackedState, world_size: int) -> str:
    """An object of DTensors (FSDP2) recovers in flight when every group of its meshes moves to new
    generations and its replicas are the blocks the controller plans with."""
    if tracked.shard_classes(obj, world_size) is None:
        return ""
    for group in dtensor_state.mesh_groups(obj):
        if not isinstance(group, SurvivingGroup):
            return (f"tracked {name!r} holds DTensors on a mesh whose group is a {type(group).__name__}, which "
                    "unbroken cannot move to a new generation; under `unbroken run` on CPU build the mesh "
                    "after unbroken.init() with init_device_mesh (its groups are then sub-groups of the default one)")
    return dtensor_state.replica_layout_problem(tracked.shard_classes(obj, world_size))


def reset_after_abort(objects: Iterable[Any]) -> None:
    """A survivor whose step was dropped: each root FSDP2 module cut mid-forward or mid-backward is
    put back to its sharded, idle state (its collectives of the cut step failed or were aborted)."""
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            fsdp_generations.reset_after_abort(obj)
