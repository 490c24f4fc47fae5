"""Each rank's own (per-rank) state, kept by the controller so that it survives the rank.

A worker reports its encoded per-rank state (RNG streams and per-rank objects, see
:mod:`unbroken.worker.rollback`) twice a step: with its ``compute`` report (the state at the
start of step k) and with its commit report (the state after the compute of step k); a report
marked ``same`` stands for the state that rank's process last sent (kept here as the rank's
``last``: its reports arrive in order on one connection), so it is not sent again. A
replacement of rank r resuming at step s gets r's own state: the start of s if kept, else the
state after computing s - 1 (a roll forward: what r had when s - 1 committed).

:class:`RankStates` is used by the controller's connection threads and its executor, always
under the controller's lock. Bounded: per rank, the captures of its newest two steps, each at
most ``limit_bytes``; captures of an older attempt are dropped when a newer one reports.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)


class Point(enum.IntEnum):
    """Where in step k a capture was taken (ordered: start of k < after compute of k < start of k + 1)."""

    START = 0
    AFTER_COMPUTE = 1


@dataclass(frozen=True)
class Found:
    """A rank's state for a resume step, and where it came from (for the event log)."""

    state: bytes
    source: str  # "start of step s" / "after compute of step s - 1"


class RankStates:
    """Per rank: attempt, and (step, point) -> encoded state of its newest two steps."""

    KEEP_STEPS = 2

    def __init__(self, limit_bytes: int) -> None:
        self._limit_bytes = limit_bytes
        self._by_rank: dict[int, tuple[int, dict[tuple[int, Point], bytes]]] = {}
        self._last: dict[int, bytes] = {}  # per rank: the state it last sent, in its held attempt

    def note_report(self, rank: int, attempt: int, step: int, point: Point, state: bytes, *, same: bool) -> None:
        """A report's state: ``state`` if sent, or (``same``) the one the rank last sent; a report
        with neither carries none."""
        if same:
            held_attempt, _ = self._by_rank.get(rank, (attempt, {}))
            if attempt < held_attempt:
                return  # a late report of an older attempt
            last = self._last.get(rank) if attempt == held_attempt else None
            if last is None:
                log.warning("controller: rank %d reported its per-rank state of step %d unchanged, but none of "
                            "attempt %d is kept; a replacement of it would get a survivor's copy", rank, step, attempt)
                return
            state = last
        if state:
            self.note(rank, attempt, step, point, state)

    def note(self, rank: int, attempt: int, step: int, point: Point, state: bytes) -> None:
        """Keep ``state``; a capture over the limit is refused (logged) and the rank's older ones dropped,
        so that a stale copy is never handed out for a newer step."""
        held_attempt, captures = self._by_rank.get(rank, (attempt, {}))
        if attempt < held_attempt:
            return  # a late report of an older attempt
        if attempt > held_attempt:
            captures = {}
            self._last.pop(rank, None)
        if len(state) > self._limit_bytes:
            log.warning("controller: rank %d's per-rank state of step %d is %d bytes, over the %d-byte limit; "
                        "not kept", rank, step, len(state), self._limit_bytes)
            self._by_rank[rank] = (attempt, {})
            self._last.pop(rank, None)
            return
        captures[(step, point)] = self._last[rank] = state
        newest = max(captures)[0]  # (the keys sort by step first)
        for key in [k for k in captures if k[0] <= newest - self.KEEP_STEPS]:
            del captures[key]
        self._by_rank[rank] = (attempt, captures)

    def for_resume(self, rank: int, attempt: int, step: int) -> Found | None:
        """Rank ``rank``'s own state to resume at ``step`` in ``attempt``, or None if not kept."""
        held_attempt, captures = self._by_rank.get(rank, (-1, {}))
        if held_attempt != attempt:
            return None
        if (step, Point.START) in captures:
            return Found(captures[(step, Point.START)], f"start of step {step}")
        if (step - 1, Point.AFTER_COMPUTE) in captures:
            return Found(captures[(step - 1, Point.AFTER_COMPUTE)], f"after compute of step {step - 1}")
        return None

    def held_bytes(self) -> int:
        return sum(len(v) for _, caps in self._by_rank.values() for v in caps.values())
