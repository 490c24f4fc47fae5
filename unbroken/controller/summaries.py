"""The nodes' summaries of their steady steps (setting node_summaries; agent/held_reports.py sends them).

Under summaries a steady step sends the controller nothing per rank: each node's agent keeps its ranks'
reports and sends, at most once a second, one :class:`~unbroken.protocol.messages.NodeSummary`. What the
controller made of each rank's report it makes of these instead:

* **the commit record**: every rank completed ``done`` steps on every node, so step ``done - 1`` committed
  (a rank updates only after its commit: worker/commit.py);
* **silence**: each node's ranks all reported within its summary's ``age_s``: the hang rule counts a rank's
  silence from there where that is later than its own last report here (controller/watchdog.py). A rank that
  stalls stops its node's summaries, and the node sends its held reports within half the shortest hang
  timeout, so the rule weighs every rank's true place, as without summaries;
* **step times** (the calibrated hang timeouts): each summary's slowest step;
* **the straggler rule**: the median of the nodes' compute-time medians is the job's; a node's slowest rank
  past ``factor`` times it is a straggler (controller/health.py, per node instead of per rank);
* **the live view**: one ``step`` record per job step, from the least ``done`` over the nodes.

:meth:`NodeSummaries.note` takes a summary in O(1) (its connection thread, under the controller's lock);
:meth:`NodeSummaries.take` is the watchdog tick's look at what came since the last one. No I/O.
"""

from __future__ import annotations

import functools
import statistics
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import repeat
from typing import NamedTuple

from unbroken.controller import health
from unbroken.protocol import messages as m


@dataclass(frozen=True)
class JobSteps:
    """What the nodes' summaries say of the job since the last look (:meth:`NodeSummaries.take`)."""

    done: int  # steps every rank completed
    step_s: float  # the slowest step among the newest summaries
    ckpt_s: float


class _Row(NamedTuple):
    """One node's newest summary: its ranks all heard at ``t`` (monotonic, here)."""

    t: float
    attempt: int
    nranks: int
    done: int
    step_s: float
    ckpt_s: float
    compute_s: float
    slow_rank: int
    slow_s: float


class NodeSummaries:
    """The newest summary of each node, straight from it or in its group's (see the module docstring)."""

    def __init__(self) -> None:
        self._rows: dict[int, _Row] = {}  # agent -> its newest summary
        self._groups: list[tuple[float, m.GroupSummary]] = []  # taken in, not yet spread into _rows
        self._direct: set[int] = set()  # agents that sent their own summary (no group, or its leader gone)
        self._new = False  # a summary came since the last take()
        self._heard: tuple[int, Mapping[int, int], dict[int, float]] | None = None  # heard()'s, until a summary
        self._hosting: tuple[tuple[int, ...], Counter[int]] | None = None  # (placement, ranks per agent)

    def note(self, agent: int, msg: m.NodeSummary, now: float) -> None:
        """A node's own summary (O(1): its connection thread, under the controller's lock)."""
        row = _Row(now - sane_age(msg.age_s), msg.attempt, msg.nranks, msg.done, msg.step_s, msg.ckpt_s, msg.compute_s,
                   msg.slow_rank, msg.slow_s)
        old = self._rows.get(agent)
        if old is None or (row.attempt, row.t) >= (old.attempt, old.t):  # (its group's copy may be newer)
            self._rows[agent] = row
        self._direct.add(agent)
        self._new, self._heard = True, None

    def note_group(self, msg: m.GroupSummary, now: float) -> bool:
        """A group's summaries (agent/summary_tree.py), kept whole until a look spreads them (O(1) here);
        False, and nothing kept, when its columns are not all as long as its agents."""
        n = len(msg.agents)
        if any(len(col) != n for col in (msg.attempts, msg.nranks, msg.done, msg.age_s, msg.compute_s,
                                         msg.slow_rank, msg.slow_s)):
            return False
        self._groups.append((now, msg))
        self._new, self._heard = True, None
        return True

    def forget(self, agent: int) -> None:
        """The agent left (or its node was lost): its summaries vouch for nothing any more."""
        self._spread()
        self._rows.pop(agent, None)
        self._heard = None

    def heard(self, attempt: int, hosting: Mapping[int, int]) -> dict[int, float]:
        """agent -> when its ranks were all heard, for each agent whose newest summary covers every rank it
        hosts in ``attempt`` (``hosting``: agent -> its number of ranks)."""
        if self._heard is None or self._heard[:2] != (attempt, hosting):  # (once per new summary, not per tick)
            self._spread()
            self._heard = (attempt, hosting, {agent: row.t for agent, row in self._rows.items()
                                              if row.attempt == attempt and row.nranks == hosting.get(agent)})
        return self._heard[2]

    def take(self, attempt: int, hosting: Mapping[int, int]) -> JobSteps | None:
        """The job's steps, when a summary came since the last call and every hosting agent has one of
        ``attempt`` that covers its ranks; else None."""
        if not self._new:
            return None
        self._new = False
        self._spread()
        rows = [self._rows.get(agent) for agent in hosting]
        if any(row is None or row.attempt != attempt or row.nranks != hosting[agent]
               for agent, row in zip(hosting, rows)):
            return None
        return JobSteps(done=min(row.done for row in rows), step_s=max(row.step_s for row in rows),
                        ckpt_s=max(row.ckpt_s for row in rows))

    def stragglers(self, attempt: int, factor: float,
                   min_excess_s: float = health.MIN_EXCESS_S) -> list[tuple[int, float, float]]:
        """(rank, its median, the job's median) of each node's slowest rank past ``factor`` times the job's
        median compute time (the median of the nodes'), once every node has its ranks' medians."""
        self._spread()
        rows = [row for row in self._rows.values() if row.attempt == attempt]
        if factor <= 0 or not rows or any(row.slow_rank < 0 for row in rows):
            return []
        job = statistics.median(row.compute_s for row in rows)
        return sorted((row.slow_rank, row.slow_s, job) for row in rows
                      if row.slow_s > factor * job and row.slow_s - job >= min_excess_s)

    def hosting(self, placement: tuple[int, ...], world_size: int, per_agent: int) -> Counter[int]:
        """agent -> how many ranks it hosts (``placement``, else ``per_agent`` ranks each), kept until it changes."""
        if self._hosting is None or (self._hosting[0] is not placement and self._hosting[0] != placement):
            counts = Counter(placement) if placement else Counter(r // per_agent for r in range(world_size))
            self._hosting = (placement, counts)
        return self._hosting[1]

    # -- helpers --------------------------------------------------------------------------------
    def _spread(self) -> None:
        """The groups' columns into per-node rows, once per look: built in C (zip, tuple.__new__), not a call
        per node (2,048 nodes: ~2 ms in Python). A group's rows only grow newer; a node's own summary (sent
        while its leader was unreachable) is kept where it is the newer."""
        groups, self._groups = self._groups, []
        for now, g in groups:
            n = len(g.agents)
            heard_t = [now - a if 0.0 <= a <= MAX_AGE_S else now for a in g.age_s]
            rows = map(_ROW, zip(heard_t, g.attempts, g.nranks, g.done, repeat(g.step_s, n), repeat(g.ckpt_s, n),
                                 g.compute_s, g.slow_rank, g.slow_s))
            own = {a: self._rows[a] for a in self._direct.intersection(g.agents) if a in self._rows}
            self._rows.update(zip(g.agents, rows))
            for agent, row in own.items():
                new = self._rows[agent]
                if (row.attempt, row.t) > (new.attempt, new.t):
                    self._rows[agent] = row


#: The oldest an agent may say a report or a summary is (a day); a negative, NaN or larger age counts as 0.
MAX_AGE_S = 86_400.0
_ROW = functools.partial(tuple.__new__, _Row)  # a _Row from a tuple, without NamedTuple's Python __new__


def sane_age(age_s: float) -> float:
    """An age as an agent said it (a held report's, a summary's), or 0 where it makes no sense."""
    return age_s if 0.0 <= age_s <= MAX_AGE_S else 0.0
