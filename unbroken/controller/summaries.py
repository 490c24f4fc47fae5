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

import statistics
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from unbroken.controller import health
from unbroken.protocol import messages as m


@dataclass(frozen=True)
class JobSteps:
    """What the nodes' summaries say of the job since the last look (:meth:`NodeSummaries.take`)."""

    done: int  # steps every rank completed
    step_s: float  # the slowest step among the newest summaries
    ckpt_s: float


class NodeSummaries:
    """The newest summary of each node (see the module docstring)."""

    def __init__(self) -> None:
        self._newest: dict[int, tuple[float, m.NodeSummary]] = {}  # agent -> (its ranks heard at, summary)
        self._new = False  # a summary came since the last take()
        self._hosting: tuple[tuple[int, ...], Counter[int]] | None = None  # (placement, ranks per agent)

    def note(self, agent: int, msg: m.NodeSummary, now: float) -> None:
        self._newest[agent] = (now - max(0.0, msg.age_s), msg)
        self._new = True

    def forget(self, agent: int) -> None:
        """The agent left (or its node was lost): its summaries vouch for nothing any more."""
        self._newest.pop(agent, None)

    def heard(self, attempt: int, hosting: Mapping[int, int]) -> dict[int, float]:
        """agent -> when its ranks were all heard, for each agent whose newest summary covers every rank it
        hosts in ``attempt`` (``hosting``: agent -> its number of ranks)."""
        return {agent: t for agent, (t, msg) in self._newest.items()
                if msg.attempt == attempt and msg.nranks == hosting.get(agent)}

    def take(self, attempt: int, hosting: Mapping[int, int]) -> JobSteps | None:
        """The job's steps, when a summary came since the last call and every hosting agent has one of
        ``attempt`` that covers its ranks; else None."""
        if not self._new:
            return None
        self._new = False
        newest = [self._newest.get(agent) for agent in hosting]
        if any(e is None or e[1].attempt != attempt or e[1].nranks != hosting[a]
               for a, e in zip(hosting, newest)):
            return None
        msgs = [e[1] for e in newest]  # (every one is there: checked above)
        return JobSteps(done=min(s.done for s in msgs), step_s=max(s.step_s for s in msgs),
                        ckpt_s=max(s.ckpt_s for s in msgs))

    def stragglers(self, attempt: int, factor: float,
                   min_excess_s: float = health.MIN_EXCESS_S) -> list[tuple[int, float, float]]:
        """(rank, its median, the job's median) of each node's slowest rank past ``factor`` times the job's
        median compute time (the median of the nodes'), once every node has its ranks' medians."""
        msgs = [msg for _, msg in self._newest.values() if msg.attempt == attempt]
        if factor <= 0 or not msgs or any(msg.slow_rank < 0 for msg in msgs):
            return []
        job = statistics.median(msg.compute_s for msg in msgs)
        return sorted((msg.slow_rank, msg.slow_s, job) for msg in msgs
                      if msg.slow_s > factor * job and msg.slow_s - job >= min_excess_s)

    def hosting(self, placement: tuple[int, ...], world_size: int, per_agent: int) -> Counter[int]:
        """agent -> how many ranks it hosts (``placement``, else ``per_agent`` ranks each), kept until it changes."""
        if self._hosting is None or (self._hosting[0] is not placement and self._hosting[0] != placement):
            counts = Counter(placement) if placement else Counter(r // per_agent for r in range(world_size))
            self._hosting = (placement, counts)
        return self._hosting[1]
