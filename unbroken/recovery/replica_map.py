"""Who holds an identical copy of each piece of training state (DESIGN.md section 5).

Pure arithmetic over (world_size, num_replicas); no torch, no process group. Recovery asks
it for a live source of every piece a lost rank held; the sharded optimizer uses the same
numbers for its layout (:class:`unbroken.optim.ShardedOptimizer`).

The data-parallel group of ``world_size`` (d) ranks is cut into ``num_replicas`` (N)
contiguous *blocks* of ``d / N`` ranks. Optimizer state is sharded inside a block, so there
are ``num_shards = d / N`` shards and each is held by N ranks, one per block:

    rank r:  block  b = r // (d/N)        shard  s = r % (d/N)
    holders of shard s:  s, s + d/N, s + 2*d/N, ...  (N ranks)

Parameters (and gradients after the sync) are held by every rank. ``N = d`` is full
replication (plain DDP + a torch optimizer: one "shard" that every rank holds; see
:meth:`ReplicaMap.full`); ``N = 1`` is plain ZeRO-1 with no replica (the seeds'
``--distributed-optimizer-no-replica``): every shard has exactly one holder.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from unbroken.errors import NoLiveReplica, OptimizerError

PieceKind = Literal["params", "optimizer_shard"]
_KINDS = ("params", "optimizer_shard")


@dataclass(frozen=True, order=True)
class Piece:
    """One unit of training state that is replicated as a whole.

    ``Piece("params", 0)``: the model parameters (every rank holds them).
    ``Piece("optimizer_shard", s)``: optimizer shard ``s`` (held by N ranks).
    """

    kind: PieceKind
    index: int = 0

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise OptimizerError(f"Piece kind {self.kind!r} is unknown; allowed: {', '.join(_KINDS)}")
        if not isinstance(self.index, int) or self.index < 0:
            raise OptimizerError(f"Piece index must be an int >= 0, got {self.index!r}")

    def __str__(self) -> str:
        return "params" if self.kind == "params" else f"optimizer shard {self.index}"


PARAMS = Piece("params", 0)


def check_layout(world_size: int, num_replicas: int) -> None:
    """Raise :class:`OptimizerError` unless ``num_replicas`` divides ``world_size``."""
    if not isinstance(world_size, int) or world_size < 1:
        raise OptimizerError(f"world_size must be an int >= 1, got {world_size!r}")
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise OptimizerError(
            f"num_replicas must be an int >= 1, got {num_replicas!r}; 1 means no replica "
            "(each optimizer shard held by one rank), world_size means full replication")
    if num_replicas > world_size:
        raise OptimizerError(
            f"num_replicas={num_replicas} is larger than the data-parallel world size {world_size}; "
            f"allowed: a divisor of {world_size} ({_divisors(world_size)})")
    if world_size % num_replicas:
        raise OptimizerError(
            f"num_replicas={num_replicas} does not divide the data-parallel world size {world_size}; "
            f"allowed: a divisor of {world_size} ({_divisors(world_size)})")


def _divisors(n: int) -> str:
    return ", ".join(str(k) for k in range(1, n + 1) if n % k == 0)


class ReplicaMap:
    """Which ranks hold an identical copy of each piece of state. Immutable; pure.

    ``ReplicaMap(world_size, num_replicas)`` for the replicated sharded optimizer;
    ``ReplicaMap.full(world_size)`` for plain full replication (a normal torch optimizer on
    every rank). Ranks are data-parallel ranks, 0 .. world_size - 1.
    """

    def __init__(self, world_size: int, num_replicas: int) -> None:
        check_layout(world_size, num_replicas)
        self.world_size = world_size
        self.num_replicas = num_replicas
        self.num_shards = world_size // num_replicas  # also the block size

    @classmethod
    def full(cls, world_size: int) -> ReplicaMap:
        """Full replication: every rank holds the parameters and all optimizer state."""
        return cls(world_size, world_size)

    def __repr__(self) -> str:
        return f"ReplicaMap(world_size={self.world_size}, num_replicas={self.num_replicas})"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, ReplicaMap) and other.world_size == self.world_size
                and other.num_replicas == self.num_replicas)

    def __hash__(self) -> int:
        return hash((self.world_size, self.num_replicas))

    # -- layout -------------------------------------------------------------------------
    def shard_of(self, rank: int) -> int:
        """The optimizer shard index ``s = rank % (d/N)`` that ``rank`` holds."""
        return self._rank(rank) % self.num_shards

    def block_of(self, rank: int) -> int:
        """The block index ``b = rank // (d/N)`` of ``rank``."""
        return self._rank(rank) // self.num_shards

    def block_ranks(self, block: int) -> list[int]:
        """The ranks of block ``block``: they hold one shard each, together all of them."""
        if not 0 <= block < self.num_replicas:
            raise OptimizerError(f"block {block} out of range: {self!r} has blocks 0..{self.num_replicas - 1}")
        start = block * self.num_shards
        return list(range(start, start + self.num_shards))

    def pieces(self) -> list[Piece]:
        """Every piece of state in the job: the parameters, then the shards in order."""
        return [PARAMS] + [Piece("optimizer_shard", s) for s in range(self.num_shards)]

    def pieces_of(self, rank: int) -> list[Piece]:
        """The pieces ``rank`` holds: the parameters and its optimizer shard."""
        return [PARAMS, Piece("optimizer_shard", self.shard_of(rank))]

    def holders(self, piece: Piece) -> list[int]:
        """Every rank holding an identical copy of ``piece``, ascending."""
        if piece.kind == "params":
            if piece.index != 0:
                raise OptimizerError(f"there is one params piece (index 0), got {piece!r}")
            return list(range(self.world_size))
        if piece.index >= self.num_shards:
            raise OptimizerError(f"{piece} does not exist: {self!r} has shards 0..{self.num_shards - 1}")
        return [piece.index + k * self.num_shards for k in range(self.num_replicas)]

    # -- recovery questions --------------------------------------------------------------
    def live_source(self, piece: Piece, alive: Iterable[int], exclude: Iterable[int] = ()) -> int | None:
        """The lowest-numbered live holder of ``piece`` not in ``exclude``; None if there is none.

        Lowest-numbered keeps the answer deterministic, so every rank computes the same
        source without talking to the others.
        """
        alive_set, excluded = set(alive), set(exclude)
        for rank in self.holders(piece):
            if rank in alive_set and rank not in excluded:
                return rank
        return None

    def sources_for(self, rank: int, alive: Iterable[int]) -> dict[Piece, int]:
        """A live source, other than ``rank`` itself, for every piece ``rank`` holds.

        Raises :class:`NoLiveReplica` naming the piece and its dead holders when some piece
        has no live holder left (then only a checkpoint can restore it).
        """
        alive_set = set(alive)
        sources: dict[Piece, int] = {}
        for piece in self.pieces_of(rank):
            source = self.live_source(piece, alive_set, exclude={rank})
            if source is None:
                holders = tuple(self.holders(piece))
                dead = tuple(r for r in holders if r not in alive_set or r == rank)
                raise NoLiveReplica(
                    f"no live replica of {piece} for rank {rank}: its holders {list(holders)} are all "
                    f"gone or being replaced (dead: {list(dead)}); num_replicas={self.num_replicas} of "
                    f"world size {self.world_size}. Restore from a checkpoint, or run with more "
                    "replicas (num_replicas) to survive this failure in flight",
                    piece=piece, holders=holders, dead=dead)
            sources[piece] = source
        return sources

    def _rank(self, rank: int) -> int:
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise OptimizerError(f"rank {rank!r} out of range for world size {self.world_size}")
        return rank
