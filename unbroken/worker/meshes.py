"""The session's side of the job's mesh (``job.mesh``): build it, wire it, report it.

:meth:`unbroken.worker.session.Job.mesh` calls :func:`attach` once per process, in the
training thread, before ``job.steps()``: the mesh (:mod:`unbroken.parallel.mesh`) is built on
every rank, its replica map goes to in-flight recovery (a replaced rank's objects come from a
live holder of its own stage and shard, :func:`unbroken.recovery.mesh_map.object_moves`), and
its pipelines warm up again at the end of each transfer. :func:`ready_fields` is what the
session's ready report tells the controller about it (the controller's feasibility check asks
the same replica map).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from unbroken.errors import ConfigError
from unbroken.parallel import mesh as job_mesh
from unbroken.parallel.mesh import JobMesh
from unbroken.parallel.fabric import Fabric
from unbroken.worker import wrappers
from unbroken.worker.inflight import InFlight
from unbroken.worker.tracked import TrackedState
from unbroken.worker_config import WorkerConfig

__all__ = ["JobMesh", "attach", "ready_fields"]


def attach(existing: JobMesh | None, dims: Iterable[tuple[str, int]], replicate: str, started: bool,
           cfg: WorkerConfig, device: torch.device, fabric: Fabric | None, inflight: InFlight) -> JobMesh:
    """Build the job's mesh and wire it to in-flight recovery (a collective of every rank).
    ``started``: ``job.steps()`` began (too late)."""
    if existing is not None or started:
        raise ConfigError("job.mesh() is called once per job, before job.steps()")
    mesh = job_mesh.build_mesh(dims, replicate=replicate, rank=cfg.rank, world_size=cfg.world_size, device=device,
                               fabric=fabric)
    inflight.replica_map = mesh.replica_map
    inflight.after_transfer.append(mesh.after_regroup)
    return mesh


def ready_fields(mesh: JobMesh | None, tracked: TrackedState, world_size: int) -> dict[str, Any]:
    """The keyword arguments of ``ControlClient.session_ready``: the fewest copies any tracked
    object keeps, why the ``tracked`` objects or the mesh cannot be recovered in flight, and the mesh."""
    ready = {"num_replicas": tracked.min_replicas(world_size),
             "not_in_flight": wrappers.in_flight_blocker(tracked, world_size)}
    if mesh is None:
        return ready
    shard_replicas, blocker = _dp_optimizers(mesh, tracked)
    return {"num_replicas": shard_replicas,
            "not_in_flight": ready["not_in_flight"] or job_mesh.in_flight_blocker(mesh) or blocker,
            "mesh": mesh.dims, "mesh_replicate": mesh.replica_map.replicate}


def _dp_optimizers(mesh: JobMesh, tracked: TrackedState) -> tuple[int, str]:
    """On a mesh: (the fewest copies of any distributed optimizer's shards inside the replicate
    dimension, 0 when there is none; why one cannot be recovered in flight, "" when it can). Such an
    optimizer must run on the mesh's replicate group (its shards' holders are then that group's)."""
    replicate = mesh.replica_map.replicate
    counts = []
    for obj in tracked.recoverable():
        if getattr(obj, "process_group", None) is not mesh.group(replicate):
            return 0, (f"a tracked {type(obj).__name__} runs on a group other than the mesh's {replicate!r} group; "
                       f"on a mesh give it process_group=mesh.group({replicate!r})")
        counts.append(obj.num_replicas)
    return min(counts, default=0), ""
