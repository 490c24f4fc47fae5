"""The restore point of a job (re)start: which step every rank loads (DESIGN.md section 8).

Pure functions, no processes. At a (re)start under `unbroken run`, every rank offers the
steps it can load: those committed in its own node's shared memory and those whose part
for it is committed in storage. A step is restorable only when *every* rank's part of it
is committed in some tier; the job resumes from the newest such step, or starts fresh
(step -1) when there is none.

Rounds: if some rank then fails to load the decided step (a file that rotted in place),
the ranks offer again in the next round and the decision must be older than every step
decided before (``below``), so the rounds always end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

MEMORY = "memory"
PEER_MEMORY = "peer_memory"  # this node's memory, fetched from another node's copy (agent/peer_memory.py)
STORAGE = "storage"


@dataclass(frozen=True)
class RankOffer:
    """The steps one rank can load: committed in its node's shared memory (``peer_steps``: those
    of them fetched from a peer node's copy), and in storage."""

    memory_steps: frozenset[int] = frozenset()
    storage_steps: frozenset[int] = frozenset()
    peer_steps: frozenset[int] = frozenset()

    @classmethod
    def of(cls, memory_steps: Iterable[int] = (), storage_steps: Iterable[int] = (),
           peer_steps: Iterable[int] = ()) -> RankOffer:
        return cls(frozenset(memory_steps), frozenset(storage_steps), frozenset(peer_steps))

    @property
    def steps(self) -> frozenset[int]:
        return self.memory_steps | self.storage_steps

    def tier_of(self, step: int) -> str:
        """Where this rank loads ``step`` from: shared memory first (its own snapshot, or a peer node's
        copy fetched there), storage last."""
        if step in self.memory_steps:
            return PEER_MEMORY if step in self.peer_steps else MEMORY
        return STORAGE


@dataclass(frozen=True)
class RestorePoint:
    """The decision: ``step`` (-1: start fresh) and, per rank, the tier it loads it from."""

    step: int
    tiers: tuple[str, ...]  # indexed by rank; () when step is -1
    reason: str

    @property
    def tier(self) -> str:
        """One word for the event log: memory, peer_memory, storage, mixed, or none (a fresh start)."""
        kinds = set(self.tiers)
        return "none" if not kinds else kinds.pop() if len(kinds) == 1 else "mixed"


def decide_restore(offers: Mapping[int, RankOffer], world_size: int, *, below: int | None = None) -> RestorePoint:
    """The newest step (< ``below`` if given) that every rank of ``world_size`` offers.

    ``offers`` must hold one offer per rank 0..world_size-1 (ValueError otherwise: the
    caller waits for all of them). Negative steps in an offer are ignored.
    """
    if world_size < 1 or set(offers) != set(range(world_size)):
        missing = sorted(set(range(world_size)) - set(offers))
        extra = sorted(set(offers) - set(range(world_size)))
        raise ValueError(f"need one offer per rank of world size {world_size} (missing ranks {missing}, "
                         f"unknown ranks {extra})")

    def usable(offer: RankOffer) -> set[int]:
        return {s for s in offer.steps if s >= 0 and (below is None or s < below)}

    per_rank = {rank: usable(offers[rank]) for rank in range(world_size)}
    common = set.intersection(*per_rank.values())
    limit = "" if below is None else f" below step {below} (a rank could not load that one)"
    if not common:
        empty = [rank for rank, steps in per_rank.items() if not steps]
        why = (f"{_ranks(empty)} have no committed step{limit}" if empty else
               f"no step{limit} is committed for every rank (newest of each: "
               f"{_ranks_newest(per_rank)})")
        return RestorePoint(-1, (), f"{why}: the job starts fresh")
    step = max(common)
    tiers = tuple(offers[rank].tier_of(step) for rank in range(world_size))
    by_tier = ", ".join(f"{tier} on {_ranks([r for r, t in enumerate(tiers) if t == tier])}"
                        for tier in (MEMORY, PEER_MEMORY, STORAGE) if tier in tiers)
    newest = max(set().union(*per_rank.values()))
    skipped = "" if newest == step else \
        f"; newer step {newest} is not committed on {_ranks([r for r, s in per_rank.items() if newest not in s])}"
    return RestorePoint(step, tiers, f"step {step} is the newest step{limit} committed for all "
                                     f"{world_size} ranks ({by_tier}){skipped}")


def _ranks(ranks: list[int], shown: int = 8) -> str:
    """Ranks as text ("ranks [0, 2]"), cut short for big jobs: a reason stays one readable line."""
    return f"ranks {ranks}" if len(ranks) <= shown else f"ranks {ranks[:shown]} and {len(ranks) - shown} more"


def _ranks_newest(per_rank: Mapping[int, set[int]], shown: int = 8) -> str:
    items = [f"rank {rank}: {max(steps)}" for rank, steps in sorted(per_rank.items())]
    return ", ".join(items[:shown]) + (f" and {len(items) - shown} more" if len(items) > shown else "")
