"""Each rank's own (per-rank) state, kept by the controller so that it survives the rank.

A worker reports its encoded per-rank state (RNG streams and per-rank objects, see
:mod:`unbroken.worker.rollback`) twice a step: with its ``compute`` report (the state at the
start of step k) and with its commit report (the state after the compute of step k); where the
commit report never left a process that died, its agent may send the state the process kept
in node memory as its reduction began (:meth:`RankStates.note_left`); a report
marked ``same`` stands for the state that rank's process last sent (kept here as the rank's
``last``: its reports arrive in order on one connection), so it is not sent again. A
replacement of rank r resuming at step s gets r's own state: the start of s if kept, else the
state after computing s - 1 (a roll forward: what r had when s - 1 committed) -- unless some rank's
state ever moved after its update (its start of k + 1 differed from its state after computing k:
a draw after ``opt.step()``, an average of per-rank statistics, post-step code): then the state
after compute is not what r resumed with, and none is given (the recovery is refused, never
guessed). Another rank's copy stands in for r's only where the two were byte-equal at the newest
point both reported (:meth:`RankStates.copy_matches`: ranks whose per-rank state is the same).

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
        self._last_at: dict[int, tuple[int, Point]] = {}  # per rank: where its process's last report was taken
        #: (rank, step): the first rank seen whose state moved after the update of that step (sticky)
        self.moved_after_update: tuple[int, int] | None = None

    def process_started(self, rank: int) -> None:
        """A new process of ``rank``: its first report follows nothing it sent (a replacement's state is
        loaded, and its encoding need not match the lost process's byte for byte)."""
        self._last_at.pop(rank, None)

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
        follows = self._last_at.get(rank) == (step - 1, Point.AFTER_COMPUTE) and point is Point.START
        before = captures.get((step - 1, Point.AFTER_COMPUTE)) if follows else None  # this process's, just before
        self._last_at[rank] = (step, point)
        if before is not None and before != state:
            self.note_moved(rank, step - 1)
        captures[(step, point)] = self._last[rank] = state
        newest = max(captures)[0]  # (the keys sort by step first)
        for key in [k for k in captures if k[0] <= newest - self.KEEP_STEPS]:
            del captures[key]
        self._by_rank[rank] = (attempt, captures)

    def note_moved(self, rank: int, step: int) -> None:
        """Rank ``rank``'s own state moved after its update of ``step`` (seen here from its reports, or by the
        rank itself where its state after compute did not travel: Progress.moved)."""
        if self.moved_after_update is not None:
            return
        self.moved_after_update = (rank, step)
        log.warning("controller: rank %d's own state at the start of step %d differs from its state after "
                    "computing step %d: it moved during the update or after the step's block; from now on a "
                    "rank lost between its update and its next step is not recovered in flight (restarted "
                    "from a checkpoint instead)", rank, step + 1, step)

    def note_left(self, rank: int, attempt: int, step: int, state: bytes) -> bool:
        """A dead process's own state as the reduction of ``step`` began, which its agent read from the file
        the process left (checkpoint/own_state.py; the process wrote it only where it stands for its state
        after compute): kept as that unless the process's commit report of ``step`` came first. It follows
        nothing and nothing follows it (a process that left sends no more). True if kept."""
        held_attempt, captures = self._by_rank.get(rank, (attempt, {}))
        newest = max(captures)[0] if captures else step
        if (attempt != held_attempt or (step, Point.AFTER_COMPUTE) in captures or len(state) > self._limit_bytes
                or step <= newest - self.KEEP_STEPS):
            return False
        captures[(step, Point.AFTER_COMPUTE)] = state
        self._by_rank[rank] = (attempt, captures)
        return True

    def for_resume(self, rank: int, attempt: int, step: int) -> Found | None:
        """Rank ``rank``'s own state to resume at ``step`` in ``attempt``, or None if none is kept
        (:meth:`why_none` says why)."""
        held_attempt, captures = self._by_rank.get(rank, (-1, {}))
        if held_attempt != attempt:
            return None
        if (step, Point.START) in captures:
            return Found(captures[(step, Point.START)], f"start of step {step}")
        if (step - 1, Point.AFTER_COMPUTE) in captures and self.moved_after_update is None:
            return Found(captures[(step - 1, Point.AFTER_COMPUTE)], f"after compute of step {step - 1}")
        return None

    def why_none(self, rank: int, attempt: int, step: int) -> str:
        """Why :meth:`for_resume` has nothing for ``rank`` at ``step`` (for refusals)."""
        held_attempt, captures = self._by_rank.get(rank, (-1, {}))
        if held_attempt == attempt and (step - 1, Point.AFTER_COMPUTE) in captures:
            moved_rank, moved_step = self.moved_after_update or (-1, -1)
            return (f"rank {rank}'s state after computing step {step - 1} is kept, but rank {moved_rank}'s own "
                    f"state moved after its update of step {moved_step}, so it need not be what rank {rank} "
                    f"started step {step} with")
        return f"rank {rank}'s own state for step {step} never reached the controller"

    def copy_matches(self, rank: int, other: int, attempt: int) -> str | None:
        """Where ``other``'s per-rank state stands in for ``rank``'s: the newest point both reported in
        ``attempt`` if their states there were byte-equal (said as "start of step k" / "after compute of
        step k"), else None (no evidence that the ranks' own states are the same)."""
        held, mine = self._by_rank.get(rank, (-1, {}))
        held_other, theirs = self._by_rank.get(other, (-1, {}))
        common = set(mine) & set(theirs) if held == held_other == attempt else set()
        if not common:
            return None
        step, point = max(common)
        if mine[(step, point)] != theirs[(step, point)]:
            return None
        return f"start of step {step}" if point is Point.START else f"after compute of step {step}"

    def held_bytes(self) -> int:
        return sum(len(v) for _, caps in self._by_rank.values() for v in caps.values())
