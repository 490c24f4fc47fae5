"""A node's steady step reports, kept by its agent; one summary to the controller instead (setting
``node_summaries``, on top of the relay: agent/relay.py sends, controller/summaries.py reads).

At 16k ranks the controller cannot take every rank's report every step (docs/scale.md: 15 us a rank, 250 ms
a step). What a steady step's compute report tells is needed only when something goes wrong: the rank's
own state at the step's start (a replacement resumes from it), where it is and since when (the hang
rule), how long its compute took (the straggler rule). So the relay keeps such reports here and sends,
at most every :data:`SUMMARY_S` and only when a rank completed a step, one
:class:`~unbroken.protocol.messages.NodeSummary`: the steps its ranks completed (the fewest: the job's
commit record is the least over the nodes), how long ago the least recent of its ranks reported (its
ranks are heard that recently: the controller's hang timeouts count from there), its slowest step time and
its compute times' medians.

**Held**: a compute report that folds in a completed step (``Progress`` with phase ``compute`` and ``done``)
and whose own state did not move after the update (``moved`` False), once :data:`HOLD_AFTER` such reports of
the rank in a row went on (a recovery's end, a new process: the controller sees their first steps). The
newest :data:`KEEP` of a rank are kept (the controller keeps a rank's states of its newest two steps,
controller/rank_state.py), each with its own state written out: a report that says its state is the one
the rank last sent (``state_same``) may follow one that is never sent on.

**Sent on**, in the order they came, each with its age (the controller times it by when the rank sent it):

* a rank's commit report (``StepSynced``, a voting step): that rank's held reports first;
* any other report that is not held (a pause, an in-step mark, a lone completed step, the loop's end):
  every held report of the node first, and holding starts over (a pause is a recovery, a mark is a rank
  waiting long: the controller then needs every rank's place);
* a stall (:meth:`HeldReports.stalled`): a rank's newest report older than ``max(STALL_FLOOR_S,
  STALL_FACTOR x the node's slowest recent step)``, at most half the hang rule's shortest calibrated
  timeout (``max(1 s, 3 x p99 step)``, controller/watchdog.py): the controller sees every rank's place
  before any timeout runs out, as without summaries;
* a rank's process exited (the relay's ``rank_gone``), its agent saw a process stopped, the controller
  asked (``FlushReports``: a rank seen stopped, whose rule needs every rank's place).

**Lost with the node**: held reports die with their node. A lost node's ranks then have no own state of
the step in flight at the controller, whose in-flight recovery refuses (controller/executor.py): the job
restarts from its newest snapshot, exact but slower. Without summaries such a loss recovers in flight.
A copy of the held reports on a peer node is not built.

Not thread-safe: the relay calls it under its lock. No I/O.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from unbroken.controller.health import WINDOW
from unbroken.names import Phase
from unbroken.protocol import messages as m

#: At most one summary per this many seconds (and only when some rank completed a step).
SUMMARY_S = 1.0
#: Reports of a rank that go on in a row before its next ones are held.
HOLD_AFTER = 3
#: Held reports kept per rank (its newest two steps' and one more).
KEEP = 3
#: A rank silent this long (at least), or STALL_FACTOR x the node's slowest recent step, is stalled.
STALL_FLOOR_S = 0.5
STALL_FACTOR = 1.5


@dataclass
class Report:
    """One worker message through the relay: from ``rank``'s process ``pid``, taken in at ``t`` (monotonic)."""

    rank: int
    pid: int
    msg: m.Message
    t: float
    batch: tuple[str, int] | None = None  # (kind, step) of a report that waits for the node's other ranks


@dataclass
class _Rank:
    pid: int
    attempt: int
    heard_t: float
    run: int = 0  # holdable reports in a row, since the last that was not (or the last release)
    held: list[Report] = field(default_factory=list)
    last_state: bytes | None = None  # its newest report's own state, where one carried it
    done: int = -1  # steps it completed, as it last said
    done_t: float | None = None  # when it said so
    step_s: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))  # between its completed steps
    compute_s: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    metrics: dict[str, Any] = field(default_factory=dict)


class HeldReports:
    """The held reports of one node's ranks and its summaries (see the module docstring)."""

    def __init__(self, summary_s: float = SUMMARY_S) -> None:
        self.summary_s = summary_s
        self._ranks: dict[int, _Rank] = {}
        self._changed = False  # a rank completed a step since the last summary
        self._summary_t = float("-inf")

    # -- the relay's calls ------------------------------------------------------------------------
    def take(self, report: Report) -> bool:
        """Keep ``report`` (True), or not (False: the relay sends it on, after :meth:`release` where
        :meth:`must_release` says so)."""
        msg, r = report.msg, self._record(report)
        r.heard_t = report.t
        state = getattr(msg, "state", b"")
        if state:
            r.last_state = state
        if type(msg) is not m.Progress:
            return False
        if msg.done:
            self._completed(r, msg, report.t)
        if msg.phase != Phase.COMPUTE or not msg.done or msg.moved:
            return False
        r.run += 1
        if r.run <= HOLD_AFTER:
            return False
        if msg.state_same:
            if r.last_state is None:  # what it refers to is not known here: it goes on as it is
                r.run = 0
                return False
            msg = dataclasses.replace(msg, state=r.last_state, state_same=False)
        r.held.append(dataclasses.replace(report, msg=msg))
        del r.held[:-KEEP]
        return True

    def must_release(self, report: Report) -> list[int] | None:
        """Whose held reports go on before ``report`` (which is not held): its rank's before its commit
        report or a compute report (a voting step; one not held yet, or whose state moved), every rank's
        before anything else (``None``: every rank's; holding starts over)."""
        msg = report.msg
        if type(msg) in (m.StepSynced, m.SyncState) or (type(msg) is m.Progress and msg.phase == Phase.COMPUTE):
            return [report.rank]
        return None

    def release(self, ranks: list[int] | None = None) -> list[Report]:
        """The held reports of ``ranks`` (None: every rank; holding then starts over for all), oldest first."""
        out: list[Report] = []
        for rank, r in self._ranks.items():
            if ranks is None or rank in ranks:
                out += r.held
                r.held = []
            if ranks is None:
                r.run = 0
        out.sort(key=lambda rep: rep.t)
        return out

    def forget(self, rank: int) -> None:
        """``rank``'s process is gone (after its held reports were released)."""
        self._ranks.pop(rank, None)

    def any_held(self) -> bool:
        return any(r.held for r in self._ranks.values())

    def stalled(self, now: float) -> bool:
        """Some rank holds reports while some rank of the node has been silent longer than the stall time."""
        if not self.any_held():
            return False
        return now - min(r.heard_t for r in self._ranks.values()) > self._stall_s()

    def _stall_s(self) -> float:
        slowest = max((max(r.step_s) for r in self._ranks.values() if r.step_s), default=0.0)
        return max(STALL_FLOOR_S, STALL_FACTOR * slowest)

    def summary(self, now: float) -> m.NodeSummary | None:
        """The node's summary, when one is due: some rank completed a step since the last one, at least
        ``summary_s`` ago, and every rank of the newest attempt here completed one."""
        if not self._changed or now - self._summary_t < self.summary_s or not self._ranks:
            return None
        attempt = max(r.attempt for r in self._ranks.values())
        ranks = [r for r in self._ranks.values() if r.attempt == attempt]
        if any(r.done < 0 for r in ranks):
            return None
        self._changed, self._summary_t = False, now
        medians = {rank: statistics.median(r.compute_s) for rank, r in self._ranks.items()
                   if r.attempt == attempt and len(r.compute_s) >= WINDOW}
        slow_rank = max(medians, key=medians.__getitem__) if len(medians) == len(ranks) else -1
        return m.NodeSummary(
            attempt=attempt, nranks=len(ranks), done=min(r.done for r in ranks),
            age_s=round(now - min(r.done_t for r in ranks if r.done_t is not None), 6),  # (step progress: not marks)
            step_s=_max_metric(ranks, "step_s"), ckpt_s=_max_metric(ranks, "ckpt_s"),
            compute_s=statistics.median(medians.values()) if slow_rank >= 0 else -1.0,
            slow_rank=slow_rank, slow_s=medians[slow_rank] if slow_rank >= 0 else -1.0)

    # -- helpers ------------------------------------------------------------------------------------
    def _record(self, report: Report) -> _Rank:
        attempt = getattr(report.msg, "attempt", -1)
        r = self._ranks.get(report.rank)
        if r is None or r.pid != report.pid or r.attempt != attempt:  # a new process of the rank
            r = self._ranks[report.rank] = _Rank(report.pid, attempt, report.t)
        return r

    def _completed(self, r: _Rank, msg: m.Progress, t: float) -> None:
        if r.done_t is not None and msg.step == r.done + 1:
            r.step_s.append(t - r.done_t)
        r.done, r.done_t, r.metrics = msg.step, t, msg.metrics
        compute_s = msg.metrics.get("compute_s")
        if isinstance(compute_s, (int, float)) and not isinstance(compute_s, bool) and compute_s >= 0:
            r.compute_s.append(float(compute_s))
        self._changed = True


def _max_metric(ranks: list[_Rank], name: str) -> float:
    values = [v for r in ranks if isinstance(v := r.metrics.get(name), (int, float)) and not isinstance(v, bool)]
    return float(max(values)) if values else 0.0
