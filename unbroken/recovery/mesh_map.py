"""Who holds an identical copy of each rank's state on a mesh (DESIGN.md section 12). Pure.

A job's mesh is a list of named dimensions, e.g. ``(("pp", 2), ("dp", 2), ("tp", 1))``, with
ranks laid out row-major as torch's ``init_device_mesh`` lays them out (the last dimension
varies fastest): rank = sum(coordinate[i] * stride[i]). For that mesh::

    rank 0: pp=0 dp=0    rank 1: pp=0 dp=1    rank 2: pp=1 dp=0    rank 3: pp=1 dp=1

Replicas live along the *replicate* dimension (``dp``): rank r's state (its pipeline stage,
its tensor-parallel shard of the parameters, its optimizer state) is one :class:`MeshPiece`,
named by r's coordinates in every other dimension, and held by every rank with those
coordinates (here ranks 0 and 1 hold stage pp=0, ranks 2 and 3 stage pp=1). With a replicate
dimension of size 1 every piece has one holder: a lost rank's state has no live replica and the
ladder falls to the checkpoint tiers.

A distributed optimizer inside the replicate dimension (``shard_replicas`` = N, a
:class:`~unbroken.optim.ShardedOptimizer` on the dp group: dp / N shards, N copies each, see
:mod:`unbroken.recovery.replica_map`) adds a second piece per rank: its optimizer shard, held by
the ranks with its other coordinates whose dp index has the same shard index ``dp % (dp / N)``.
With N = 1 that piece has one holder: a kill falls to the checkpoint tiers even with dp > 1.

:class:`MeshReplicaMap` answers the replica questions (:class:`~unbroken.recovery.replicas.Replicas`:
``pieces_of``, ``holders``, ``live_source``, ``sources_for``) as
:class:`~unbroken.recovery.replica_map.ReplicaMap` does for a flat data-parallel job, so the
controller asks either the same way. :func:`object_moves` plans the
transfer of the replicated objects a session tracks to the replaced ranks. No torch here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from unbroken.errors import ConfigError, NoLiveReplica
from unbroken.recovery.transfer_plan import Move, plan_moves

Dims = tuple[tuple[str, int], ...]


@dataclass(frozen=True, order=True)
class MeshPiece:
    """The state every rank with these coordinates holds (all dimensions but the replicate one);
    with ``shard`` >= 0, optimizer shard ``shard`` inside the replicate dimension of those ranks."""

    coords: tuple[tuple[str, int], ...]
    shard: int = -1

    def __str__(self) -> str:
        where = ", ".join(f"{name}={index}" for name, index in self.coords)
        if self.shard >= 0:
            return f"optimizer shard {self.shard} of {where}" if where else f"optimizer shard {self.shard}"
        return f"the state of {where}" if where else "the state (every rank holds it)"


def check_dims(dims: Iterable[tuple[str, int]], replicate: str) -> Dims:
    """``dims`` as a tuple; ConfigError naming the problem unless they make a valid mesh."""
    out = tuple(tuple(d) for d in dims)
    if not out:
        raise ConfigError("a mesh needs at least one dimension, e.g. (('pp', 2), ('dp', 2))")
    for dim in out:
        ok = len(dim) == 2 and isinstance(dim[0], str) and dim[0] and type(dim[1]) is int and dim[1] >= 1
        if not ok:
            raise ConfigError(f"mesh dimension {dim!r} must be (name, size) with a non-empty name and a size >= 1")
    names = [name for name, _ in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"mesh dimension names must differ, got {names}")
    if replicate not in names:
        raise ConfigError(f"the replicate dimension {replicate!r} is not a mesh dimension (dimensions: {names}); "
                          "name the data-parallel dimension, where the replicas live")
    return out  # type: ignore[return-value]


class MeshReplicaMap:
    """The layout of a mesh and who holds each rank's state. Immutable; pure."""

    def __init__(self, dims: Iterable[tuple[str, int]], replicate: str = "dp", shard_replicas: int = 0) -> None:
        self.dims = check_dims(dims, replicate)
        self.replicate = replicate
        self.names = tuple(name for name, _ in self.dims)
        self.sizes = tuple(size for _, size in self.dims)
        self.world_size = math.prod(self.sizes)
        self.shard_replicas = _check_shard_replicas(shard_replicas, dict(self.dims)[replicate], replicate)
        strides, step = [], 1
        for size in reversed(self.sizes):
            strides.append(step)
            step *= size
        self._strides = tuple(reversed(strides))

    def __repr__(self) -> str:
        extra = f", shard_replicas={self.shard_replicas}" if self.shard_replicas else ""
        return f"MeshReplicaMap({list(self.dims)}, replicate={self.replicate!r}{extra})"

    def _key(self) -> tuple:
        return self.dims, self.replicate, self.shard_replicas

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MeshReplicaMap) and other._key() == self._key()

    def __hash__(self) -> int:
        return hash(self._key())

    @property
    def num_replicas(self) -> int:
        """Copies of each piece: the size of the replicate dimension."""
        return self.sizes[self.names.index(self.replicate)]

    # -- layout ------------------------------------------------------------------------
    def coords_of(self, rank: int) -> dict[str, int]:
        """``{dimension: index}`` of ``rank``."""
        self._check_rank(rank)
        return {name: (rank // stride) % size for name, size, stride in zip(self.names, self.sizes, self._strides)}

    def rank_of(self, coords: dict[str, int]) -> int:
        """The rank at ``coords`` (every dimension named)."""
        if set(coords) != set(self.names):
            raise ConfigError(f"coordinates {coords} must name every mesh dimension {list(self.names)}")
        for name, size in self.dims:
            if not 0 <= coords[name] < size:
                raise ConfigError(f"coordinate {name}={coords[name]} out of range 0..{size - 1}")
        return sum(coords[name] * stride for name, stride in zip(self.names, self._strides))

    def group_ranks(self, dim: str, rank: int) -> list[int]:
        """The ranks of ``rank``'s group along ``dim`` (they differ from it only there), ascending."""
        if dim not in self.names:
            raise ConfigError(f"{dim!r} is not a mesh dimension (dimensions: {list(self.names)})")
        coords = self.coords_of(rank)
        return [self.rank_of({**coords, dim: i}) for i in range(self.sizes[self.names.index(dim)])]

    # -- the replica questions (as ReplicaMap answers them) -------------------------------
    def piece_of(self, rank: int) -> MeshPiece:
        coords = self.coords_of(rank)
        return MeshPiece(tuple((name, coords[name]) for name in self.names if name != self.replicate))

    @property
    def num_shards(self) -> int:
        """Optimizer shards inside the replicate dimension (1 without a distributed optimizer)."""
        return self.num_replicas // self.shard_replicas if self.shard_replicas else 1

    def shard_piece_of(self, rank: int) -> MeshPiece | None:
        """``rank``'s optimizer shard inside the replicate dimension; None without a distributed optimizer."""
        if not self.shard_replicas:
            return None
        return MeshPiece(self.piece_of(rank).coords, self.coords_of(rank)[self.replicate] % self.num_shards)

    def pieces(self) -> list[MeshPiece]:
        """Every piece of the job, in rank order of their first holder."""
        return sorted({p for r in range(self.world_size) for p in self.pieces_of(r)},
                      key=lambda p: (self.holders(p)[0], p.shard))

    def pieces_of(self, rank: int) -> list[MeshPiece]:
        """``rank``'s stage and shard of the parameters, then its optimizer shard (if sharded)."""
        shard = self.shard_piece_of(rank)
        return [self.piece_of(rank)] + ([shard] if shard is not None else [])

    def holders(self, piece: MeshPiece) -> list[int]:
        """Every rank holding ``piece``, ascending."""
        names = tuple(name for name in self.names if name != self.replicate)
        if tuple(name for name, _ in piece.coords) != names:
            raise ConfigError(f"{piece} does not name this mesh's dimensions {list(names)}")
        if piece.shard >= self.num_shards:
            raise ConfigError(f"{piece} does not exist: {self!r} has optimizer shards 0..{self.num_shards - 1}")
        coords = dict(piece.coords)
        return [self.rank_of({**coords, self.replicate: i}) for i in range(self.num_replicas)
                if piece.shard < 0 or i % self.num_shards == piece.shard]

    def replicas_of(self, rank: int) -> list[int]:
        """The ranks holding what ``rank`` holds (``rank`` among them)."""
        return self.holders(self.piece_of(rank))

    def live_source(self, piece: MeshPiece, alive: Iterable[int], exclude: Iterable[int] = ()) -> int | None:
        """The lowest live holder of ``piece`` not in ``exclude``; None if there is none."""
        alive_set, excluded = set(alive), set(exclude)
        return next((r for r in self.holders(piece) if r in alive_set and r not in excluded), None)

    def sources_for(self, rank: int, alive: Iterable[int]) -> dict[MeshPiece, int]:
        """A live source other than ``rank`` for each of its pieces; NoLiveReplica when one has none."""
        alive_set, sources = set(alive), {}
        for piece in self.pieces_of(rank):
            source = self.live_source(piece, alive_set, exclude={rank})
            if source is None:
                holders = tuple(self.holders(piece))
                dead = tuple(r for r in holders if r not in alive_set or r == rank)
                more = "more optimizer shard copies (num_replicas)" if piece.shard >= 0 else \
                    f"a larger {self.replicate!r} dimension"
                raise NoLiveReplica(
                    f"no live replica of {piece} for rank {rank}: its holders {list(holders)} (along "
                    f"{self.replicate!r}, size {self.num_replicas}) are all gone or being replaced; restore from a "
                    f"checkpoint, or run with {more} to survive this failure in flight",
                    piece=str(piece), holders=holders, dead=dead)
            sources[piece] = source
        return sources

    def _check_rank(self, rank: int) -> None:
        if type(rank) is not int or not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank!r} out of range for the mesh {list(self.dims)} "
                              f"({self.world_size} ranks)")


def _check_shard_replicas(shard_replicas: int, size: int, replicate: str) -> int:
    if type(shard_replicas) is not int or shard_replicas < 0 or (shard_replicas and size % shard_replicas):
        raise ConfigError(f"shard_replicas={shard_replicas!r} must be 0 (no distributed optimizer) or a divisor of "
                          f"the {replicate!r} dimension's size {size}")
    return shard_replicas


def object_moves(names: Sequence[str], replicas: MeshReplicaMap | None, replaced: Iterable[int],
                 alive: Sequence[int]) -> tuple[list[Move], dict[str, str]]:
    """The moves that bring each replicated tracked object to the replaced ranks, and the object
    name of each move's key. The same on every rank.

    Without a mesh every rank holds every object (key ``object 'model'``). On a mesh a replaced
    rank needs *its* piece's copy (its stage, its shard): key ``object 'model' of <piece>``, from a
    live holder of that piece. Raises NoLiveReplica when a piece has none.
    """
    replaced = sorted(set(replaced))
    if replicas is None:
        keys = {f"object {name!r}": name for name in names}
        moves = plan_moves(list(keys), {k: alive for k in keys}, {k: replaced for k in keys}, alive)
        return moves, keys
    keys, holders, needs = {}, {}, {}
    for piece in sorted({replicas.piece_of(r) for r in replaced}):
        for name in names:
            key = f"object {name!r} of {piece}"
            keys[key], holders[key] = name, replicas.holders(piece)
            needs[key] = [r for r in replaced if replicas.piece_of(r) == piece]
    return plan_moves(list(keys), holders, needs, alive), keys
