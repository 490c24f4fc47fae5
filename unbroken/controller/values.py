"""Immutable values the job state machine carries from one event to the next, cheap at any size.

The machine (controller/machine.py) is a pure function: every event returns a new state. With
the rank sets as frozensets, adding one rank copied the set, so a step's N commit reports, or a
recovery's N pause and N resume reports, cost O(N^2): 2.2 s of controller CPU per recovery at
4,096 ranks, 6.8 s at 8,192 (benchmarks/controller_scale.py). Here:

- :class:`RankSet`: a set of ranks as the bits of one int, immutable; adding a rank, a
  membership test, a count, a union or a comparison is one C-level pass over N/30 digits
  (~1 us at 10k ranks), not a Python-level copy of N elements. It compares equal to the
  frozenset of the same ranks, so callers and tests keep reading it as a set.
- :class:`Chain`: a persistent list (newest first) for what is appended once per rank.
- :func:`replace`: ``dataclasses.replace`` without re-running ``__init__`` (a state has ~30
  fields; the stock one took ~20 us per event), for frozen dataclasses without ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")
D = TypeVar("D")


class RankSet:
    """An immutable set of non-negative ints (ranks), stored as a bit mask."""

    __slots__ = ("_mask",)

    def __init__(self, ranks: Iterable[int] = ()) -> None:
        object.__setattr__(self, "_mask", _mask_of(ranks))

    @classmethod
    def _of(cls, mask: int) -> RankSet:
        new = object.__new__(cls)
        object.__setattr__(new, "_mask", mask)
        return new

    @classmethod
    def full(cls, n: int) -> RankSet:
        """Ranks 0 .. n - 1."""
        return cls._of((1 << n) - 1)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("a RankSet is immutable")

    def with_rank(self, rank: int) -> RankSet:
        if rank < 0:
            raise ValueError(f"a rank set holds ranks >= 0, not {rank}")
        return RankSet._of(self._mask | (1 << rank))

    # -- the frozenset interface the machine uses ------------------------------------------------
    def __contains__(self, rank: object) -> bool:
        return isinstance(rank, int) and rank >= 0 and (self._mask >> rank) & 1 == 1

    def __len__(self) -> int:
        return self._mask.bit_count()

    def __bool__(self) -> bool:
        return self._mask != 0

    def __iter__(self) -> Iterator[int]:
        bits = bin(self._mask)[:1:-1]  # lowest bit first
        return (i for i, bit in enumerate(bits) if bit == "1")

    def __or__(self, other: Iterable[int]) -> RankSet:
        return RankSet._of(self._mask | _mask_of(other))

    def __and__(self, other: Iterable[int]) -> RankSet:
        return RankSet._of(self._mask & _mask_of(other, ignore_negative=True))

    def __sub__(self, other: Iterable[int]) -> RankSet:
        return RankSet._of(self._mask & ~_mask_of(other, ignore_negative=True))

    # A builtin set on the left keeps its type, as between two builtin sets (set & frozenset is a set).
    def __ror__(self, other: set[int] | frozenset[int]) -> set[int] | frozenset[int]:
        return type(other)(other | frozenset(self))

    def __rand__(self, other: set[int] | frozenset[int]) -> set[int] | frozenset[int]:
        return type(other)(r for r in other if r in self)

    def __rsub__(self, other: set[int] | frozenset[int]) -> set[int] | frozenset[int]:
        return type(other)(r for r in other if r not in self)

    def __le__(self, other: Iterable[int]) -> bool:
        return self._mask & ~_mask_of(other, ignore_negative=True) == 0

    def __ge__(self, other: Iterable[int]) -> bool:
        try:
            return _mask_of(other) & ~self._mask == 0
        except ValueError:  # a negative rank: in no RankSet
            return False

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RankSet):
            return self._mask == other._mask
        if isinstance(other, (set, frozenset)):
            return all(isinstance(r, int) and r >= 0 for r in other) and self._mask == _mask_of(other)
        return NotImplemented

    def __hash__(self) -> int:  # equal to the frozenset of the same ranks, so its hash too
        return hash(frozenset(self))

    def __repr__(self) -> str:
        return f"RankSet({sorted(self)})"


def _mask_of(ranks: Iterable[int], *, ignore_negative: bool = False) -> int:
    """The mask of ``ranks``; a negative one is left out where that gives the set answer (it is in
    no RankSet: for &, - and <=), else ValueError (a union or a superset test cannot hold it)."""
    if isinstance(ranks, RankSet):
        return ranks._mask
    mask = 0
    for r in ranks:
        if r < 0:
            if ignore_negative:
                continue
            raise ValueError(f"a rank set holds ranks >= 0, not {r}")
        mask |= 1 << r
    return mask


@dataclasses.dataclass(frozen=True)
class Chain(Generic[T]):
    """A persistent list, newest first: ``chain.push(x)`` is O(1) and leaves ``chain`` as it was."""

    head: T | None = None
    rest: Chain[T] | None = None
    size: int = 0

    def push(self, item: T) -> Chain[T]:
        return Chain(item, self, self.size + 1)

    def __iter__(self) -> Iterator[T]:
        node: Chain[T] | None = self
        while node is not None and node.size:
            yield node.head  # type: ignore[misc]
            node = node.rest

    def __len__(self) -> int:
        return self.size


def replace(obj: D, **changes: Any) -> D:
    """A copy of the frozen dataclass ``obj`` with ``changes``; a name that is no field raises
    TypeError, as ``dataclasses.replace`` does. Not for classes with ``__post_init__``."""
    fields = type(obj).__dataclass_fields__  # type: ignore[attr-defined]
    unknown = changes.keys() - fields.keys()
    if unknown:
        raise TypeError(f"{type(obj).__name__} has no field(s) {sorted(unknown)}")
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    new.__dict__.update(changes)
    return new
