"""Who holds an identical copy of each piece of a rank's state: the one question recovery asks
of a job's layout (DESIGN.md sections 5 and 12), declared once. Pure; no torch.

Two layouts answer it: :class:`~unbroken.recovery.replica_map.ReplicaMap` (flat data parallel,
with a replicated sharded optimizer inside) and :class:`~unbroken.recovery.mesh_map.MeshReplicaMap`
(a job's mesh, replicas along its replicate dimension). Each has pieces of its own kind
(``Piece``, ``MeshPiece``: hashable, ordered, printable); the ladder, the controller's machine
and its durable mirror ask either through :class:`Replicas` alone, and
:func:`job_replicas` picks the one a job's shape calls for.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Protocol, TypeVar

from unbroken.recovery.mesh_map import MeshReplicaMap
from unbroken.recovery.replica_map import ReplicaMap

PieceT = TypeVar("PieceT", bound=Hashable)


class Replicas(Protocol[PieceT]):
    """The replica questions. Every answer is the same on every rank that asks (lowest rank
    first), so ranks agree on a source without talking."""

    world_size: int

    def pieces(self) -> list[PieceT]:
        """Every piece of state in the job."""
        ...

    def pieces_of(self, rank: int) -> list[PieceT]:
        """The pieces ``rank`` holds."""
        ...

    def holders(self, piece: PieceT) -> list[int]:
        """Every rank holding an identical copy of ``piece``, ascending."""
        ...

    def live_source(self, piece: PieceT, alive: Iterable[int], exclude: Iterable[int] = ()) -> int | None:
        """The lowest live holder of ``piece`` not in ``exclude``; None if there is none."""
        ...

    def sources_for(self, rank: int, alive: Iterable[int]) -> dict[PieceT, int]:
        """A live source other than ``rank`` for each of its pieces; NoLiveReplica when one has none."""
        ...


def job_replicas(world_size: int, num_replicas: int, mesh: Sequence[tuple[str, int]] = (),
                 mesh_replicate: str = "dp") -> Replicas:
    """Who holds what in a job of this shape: its mesh (replicas along ``mesh_replicate``; then
    ``num_replicas`` counts the copies of a distributed optimizer's shards inside it, 0: none),
    else the flat data-parallel layout of ``num_replicas`` copies (0: full replication)."""
    if mesh:
        return MeshReplicaMap(mesh, mesh_replicate, shard_replicas=num_replicas)
    return ReplicaMap(world_size, num_replicas) if num_replicas else ReplicaMap.full(world_size)


def holders_of_all(replicas: Replicas, rank: int) -> tuple[int, ...]:
    """Every rank holding all that ``rank`` holds (``rank`` among them), ascending."""
    holders: set[int] | None = None
    for piece in replicas.pieces_of(rank):
        these = set(replicas.holders(piece))
        holders = these if holders is None else holders & these
    return tuple(sorted(holders or {rank}))
