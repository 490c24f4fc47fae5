"""Who sends which piece of state to whom after an in-flight regroup: pure, no torch.

Every rank computes the same plan from the same inputs (the pieces, their holders from the
replica map, the ranks being replaced), so no rank has to ask another. A piece goes to each
rank that needs it from exactly one live holder; among the live holders of a piece the one
with the fewest moves so far is chosen (ties: the lowest rank), so pieces spread across the
holders and travel in parallel. A rank that neither sends nor receives is in no move.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from unbroken.errors import NoLiveReplica


class Move(NamedTuple):
    """Piece ``key`` goes from rank ``src`` (a live holder) to rank ``dst``."""

    key: str
    src: int
    dst: int


def plan_moves(pieces: Sequence[str], holders: Mapping[str, Sequence[int]], needs: Mapping[str, Sequence[int]],
               alive: Iterable[int]) -> list[Move]:
    """The moves that bring every piece of ``pieces`` to the ranks in ``needs[piece]``.

    ``holders[piece]``: the ranks that hold an identical copy (the replica map's answer);
    only the ``alive`` ones send, never to themselves. Pieces are planned in the order given
    and receivers ascending, so the plan is the same on every rank. Raises
    :class:`NoLiveReplica` naming the piece when a piece someone needs has no live holder.
    """
    alive_set = set(alive)
    load: Counter[int] = Counter()
    moves: list[Move] = []
    for key in pieces:
        for dst in sorted(set(needs.get(key, ()))):
            live = sorted(r for r in set(holders.get(key, ())) if r in alive_set and r != dst)
            if not live:
                held = tuple(sorted(set(holders.get(key, ()))))
                raise NoLiveReplica(
                    f"no live holder of {key} for rank {dst}: its holders {list(held)} are all gone or being "
                    "replaced; restore from a checkpoint, or keep more replicas (num_replicas)",
                    piece=key, holders=held, dead=tuple(r for r in held if r not in alive_set))
            src = min(live, key=lambda r: (load[r], r))
            load[src] += 1
            moves.append(Move(key, src, dst))
    return moves


def movers(moves: Iterable[Move]) -> list[int]:
    """The ranks that send or receive in ``moves``, ascending."""
    return sorted({r for m in moves for r in (m.src, m.dst)})


def involved(moves: Iterable[Move], rank: int) -> bool:
    """True if ``rank`` sends or receives in ``moves``."""
    return any(rank in (m.src, m.dst) for m in moves)
