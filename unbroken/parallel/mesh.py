"""The job's mesh in one process: torch's ``DeviceMesh`` over groups that survive generations.

``job.mesh(("pp", 2), ("dp", 2), ("tp", 1))`` (:func:`build_mesh`) builds a
``torch.distributed.device_mesh.DeviceMesh`` with ``init_device_mesh``. Under `unbroken run` on
CPU the default group is the :class:`~unbroken.parallel.fabric.Fabric`'s world group, so every
sub-group torch creates for the mesh (one per dimension this rank belongs to) is a
:class:`~unbroken.parallel.group.SurvivingGroup`: the same objects for the whole job, moved to
each generation's gloo groups by :meth:`Fabric.switch` (which builds and connects every one of
them, in creation order, on every rank), abortable on an abort order. Each sub-group is warmed by
one collective before step 0 (the seeds' "proactive link setup"); a replacement, which builds its
mesh while the survivors wait in the regroup, skips that (its groups are held: collectives local).

The mesh's layout is a :class:`~unbroken.recovery.mesh_map.MeshReplicaMap`: rank r's state is
held by the ranks with r's coordinates in every dimension but the replicate one (``dp``). The
session gives it to in-flight recovery (who sends a replaced rank its objects) and reports it to
the controller (is every lost piece still held somewhere?).

Pipeline schedules (``torch.distributed.pipelining``) run a warm-up exchange between stages on
their first step only; a replacement's schedule would run it on the redone step while the
survivors' would not, and the two would wait on each other. :meth:`JobMesh.pipeline` registers a
schedule so that after every regroup every rank's schedule warms up again at the redo.

Runs in the training thread of one rank.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from unbroken.errors import ConfigError
from unbroken.parallel.fabric import Fabric
from unbroken.parallel.group import SurvivingGroup
from unbroken.recovery.mesh_map import MeshReplicaMap

# The flags torch's single-stage schedules (ScheduleGPipe, Schedule1F1B: torch 2.13) keep to run
# their stage's warm-up (p2p vote, metadata, recv buffers) once; cleared, it runs at the next step.
_SCHEDULE_INIT_FLAGS = ("_stage_forward_initialized", "_stage_backward_initialized")


class JobMesh:
    """One rank's view of the job's mesh: the torch ``DeviceMesh`` (:attr:`device_mesh`), this
    rank's coordinate and group along each dimension, the replica map, and the pipeline schedules
    to warm up again after each regroup. Built by :func:`build_mesh`; lives as long as the job."""

    def __init__(self, device_mesh: DeviceMesh, replica_map: MeshReplicaMap, rank: int) -> None:
        self.device_mesh, self.replica_map, self.rank = device_mesh, replica_map, rank
        self._coords = replica_map.coords_of(rank)
        self._schedules: list[Any] = []

    def __repr__(self) -> str:
        where = ", ".join(f"{n}={i}" for n, i in self._coords.items())
        return f"JobMesh({list(self.replica_map.dims)}, rank {self.rank} at {where})"

    @property
    def dims(self) -> tuple[tuple[str, int], ...]:
        return self.replica_map.dims

    def coord(self, dim: str) -> int:
        """This rank's index along ``dim`` (its pipeline stage for ``"pp"``)."""
        self._check_dim(dim)
        return self._coords[dim]

    def size(self, dim: str) -> int:
        self._check_dim(dim)
        return dict(self.replica_map.dims)[dim]

    def group(self, dim: str) -> dist.ProcessGroup:
        """This rank's process group along ``dim`` (a SurvivingGroup under `unbroken run` on CPU)."""
        self._check_dim(dim)
        return self.device_mesh.get_group(dim)

    def group_ranks(self, dim: str) -> list[int]:
        """The job ranks of this rank's group along ``dim``, in group-rank order."""
        return self.replica_map.group_ranks(dim, self.rank)

    def pipeline(self, schedule: Any) -> Any:
        """Register a single-stage pipeline schedule (``ScheduleGPipe``, ``Schedule1F1B``) built on
        this mesh's ``pp`` group; returns it. After each regroup its warm-up runs again at the redo
        on every rank (see the module docstring)."""
        missing = [f for f in _SCHEDULE_INIT_FLAGS if not hasattr(schedule, f)]
        if missing:
            raise ConfigError(f"job.mesh(...).pipeline(): a {type(schedule).__name__} has no {missing}; "
                              "give a torch.distributed.pipelining single-stage schedule (ScheduleGPipe, "
                              "Schedule1F1B) of torch 2.13")
        self._schedules.append(schedule)
        return schedule

    def after_regroup(self) -> None:
        """Every rank, at the end of each in-flight transfer: the pipelines warm up again."""
        for schedule in self._schedules:
            for flag in _SCHEDULE_INIT_FLAGS:
                setattr(schedule, flag, False)
            losses = getattr(schedule, "_internal_losses", None)
            if losses is not None:  # an aborted step's partial micro-batch losses (the last stage)
                losses.clear()

    def _check_dim(self, dim: str) -> None:
        if dim not in self._coords:
            raise ConfigError(f"{dim!r} is not a dimension of the job's mesh (dimensions: {list(self._coords)})")


def build_mesh(dims: Iterable[tuple[str, int]], *, replicate: str, rank: int, world_size: int,
               device: torch.device, fabric: Fabric | None) -> JobMesh:
    """Build the job's mesh on every rank (a collective: every rank calls it at the same point)."""
    replica_map = MeshReplicaMap(dims, replicate)  # ConfigError for a bad mesh
    if replica_map.world_size != world_size:
        sizes = " x ".join(f"{n}={s}" for n, s in replica_map.dims)
        raise ConfigError(f"job.mesh({sizes}) has {replica_map.world_size} ranks but the job has {world_size}; "
                          "the product of the dimension sizes must equal the world size")
    device_mesh = init_device_mesh(device.type, replica_map.sizes, mesh_dim_names=replica_map.names)
    mesh = JobMesh(device_mesh, replica_map, rank)
    if fabric is None or not fabric.world.held:
        warm(mesh, device)
    return mesh


def warm(mesh: JobMesh, device: torch.device) -> None:
    """One all-reduce on each of this rank's mesh groups (the links are up before step 0)."""
    for name, _ in mesh.dims:
        group = mesh.group(name)
        if isinstance(group, SurvivingGroup) and (group.held or group.backend is None):
            continue
        dist.all_reduce(torch.zeros(1, device=device), group=group)


def in_flight_blocker(mesh: JobMesh | None) -> str:
    """Why this mesh's groups cannot be recovered in flight ("" when they can)."""
    if mesh is None:
        return ""
    for name, _ in mesh.dims:
        group = mesh.group(name)
        if not isinstance(group, SurvivingGroup):
            return (f"its mesh's {name!r} group is a {type(group).__name__}, which unbroken cannot abort or move to "
                    "a new generation; under `unbroken run` on CPU call job.mesh() without building a default "
                    "group first")
    return ""
