"""Which rank a hang is blamed on. Pure: the server feeds it what it knows of every rank.

In synchronous training a rank that stops progressing makes its peers block in a collective
it never reached: the step's reduction (phase ``sync``), its commit vote (``vote``: the rank
reported its reduction done after joining the vote), or a broadcast or gather of its compute
(``collective``: DDP broadcasts its buffers as the forward begins); they then look as silent as the culprit,
and the ones that began waiting earliest cross the hang timeout first. So the timeout only
says *that* something hangs; *who* is decided among all live ranks, by evidence, strongest first:

1. the agent sees the rank's process stopped (SIGSTOP, a debugger) or a zombie;
2. the rank is not waiting at the *front*, the furthest (step, phase) where ranks wait in a
   collective, while others do: it is behind them (in compute while they wait in the reduction,
   in the reduction while they wait in the vote, still in step k while they wait in step k + 1);
3. the rank silent the longest; then the lowest rank (deterministic).

During a recovery every survivor must answer the abort order (pause) within its hang
timeout; one that does not is hung itself (:func:`silent_in_recovery`), and is handled
like any hang, not left to the recovery deadline.

After its step loop a rank reports no progress any more (a final save may take long), so
only the agent's evidence counts there: a process stopped (or a zombie) for longer than its
hang timeout is hung after its loop (:func:`hung_after_loop`; controller/loop_end.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from unbroken.names import Phase

#: Process states, as the agent reports them (from /proc via psutil).
NOT_RUNNING = ("stopped", "zombie")
#: The phases in which a rank waits for all the others (a collective of the step).
WAITING = (Phase.COLLECTIVE, Phase.SYNC, Phase.VOTE)
_ORDER = {Phase.COMPUTE: 0, Phase.COLLECTIVE: 1, Phase.SYNC: 2, Phase.VOTE: 3, Phase.UPDATE: 4, Phase.DONE: 5}


@dataclass(frozen=True)
class RankProgress:
    """One live rank as the controller sees it when it looks for a hang."""

    rank: int
    phase: str  # the last phase it reported (compute, sync, update, done, starting, ...)
    silent_s: float  # since its last step progress
    timeout_s: float  # its hang timeout now
    process: str = "running"  # as its agent sees it: running | stopped | zombie
    step: int = -1  # the step it was last in (its index), -1 if it reported none

    @property
    def position(self) -> tuple[int, int]:
        return self.step, _ORDER.get(self.phase, -1)


def front(ranks: Iterable[RankProgress]) -> tuple[int, int] | None:
    """The furthest position at which some rank waits in a collective (None: nobody waits)."""
    return max((r.position for r in ranks if r.phase in WAITING), default=None)


def at_front(rank: RankProgress, where: tuple[int, int] | None) -> bool:
    return rank.phase in WAITING and rank.position == where


def blame_hang(ranks: Sequence[RankProgress]) -> RankProgress | None:
    """The rank to blame, or ``None`` while no rank is past its hang timeout."""
    if not any(r.silent_s > r.timeout_s for r in ranks):
        return None
    where = front(ranks)
    return min(ranks, key=lambda r: (r.process not in NOT_RUNNING, at_front(r, where), -r.silent_s, r.rank))


def why(rank: RankProgress, others: Iterable[RankProgress]) -> str:
    """The evidence against ``rank``, for the event log."""
    if rank.process in NOT_RUNNING:
        return f"its process is {rank.process}"
    others = list(others)
    where = front(others)
    waiting = sorted(o.rank for o in others if o.rank != rank.rank and at_front(o, where))
    if not at_front(rank, where) and waiting:
        phase = next(o.phase for o in others if o.rank == waiting[0])
        return (f"it never reached the collective (phase {rank.phase}{_of(rank.step)}) while ranks {waiting} "
                f"wait in {phase}{_of(where[0])}")
    return f"silent the longest ({rank.silent_s:.1f} s)"


def _of(step: int) -> str:
    return f" of step {step}" if step >= 0 else ""


def silent_in_recovery(ranks: Sequence[RankProgress], answered: Iterable[int]) -> RankProgress | None:
    """A survivor that has not answered the abort order within its hang timeout (``silent_s``
    counted from the order), a stopped one first; ``None`` if every one answered or has time left."""
    done = set(answered)
    late = [r for r in ranks if r.rank not in done and r.silent_s > r.timeout_s]
    return min(late, key=lambda r: (r.process not in NOT_RUNNING, -r.silent_s, r.rank)) if late else None


def lingering_after_loop(rank: RankProgress) -> RankProgress | None:
    """The last rank of a job still running past its step loop, ``silent_s`` after every other rank
    exited, once that is longer than its ``timeout_s`` (``--exit-timeout-s``): nobody trains with it
    any more, so a final save or ``job.close()`` that long is taken for a hang; else ``None``."""
    return rank if rank.silent_s > rank.timeout_s else None


def hung_after_loop(ranks: Sequence[RankProgress]) -> RankProgress | None:
    """A rank past its step loop whose process has been stopped or a zombie (``silent_s``: since
    its agent saw it so) for longer than its hang timeout, the longest first; ``None`` if none is.
    A running process past its loop is never blamed: nothing tells a long final save from a hang."""
    late = [r for r in ranks if r.process in NOT_RUNNING and r.silent_s > r.timeout_s]
    return min(late, key=lambda r: (-r.silent_s, r.rank)) if late else None
