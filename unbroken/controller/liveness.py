"""Node liveness: heartbeats both ways between the controller and every agent, and the timing rules.

A node whose processes are frozen (SIGSTOP, a kernel stall) or whose link is cut keeps its TCP
connections open: nothing closes and nothing errors, silence is the only sign. So, under
``--node-timeout-s T``:

* the controller and every agent each send a ``Heartbeat`` every :func:`beat_interval_s` (T / 5, at most
  1 s); any message counts as one;
* the controller declares an agent lost after T without a message from it: it closes that agent's
  connection and its workers' (a frozen node that wakes up finds them closed), and the node's ranks
  take the recovery ladder as a lost node (``agent_lost`` with ``silent_s``);
* an agent that heard nothing from the controller for :func:`fence_after_s` (T / 2) kills its own
  workers and exits (agent/agent.py): fencing. Both silences start with the same cut, and the
  controller's beats come every T / 5 or sooner, so the node has fenced itself at least 0.3 T before the
  controller can declare it lost and hand its ranks to another node: nobody trains on a generation
  it no longer belongs to. A frozen node cannot fence itself; when it wakes, its agent fences at
  once and its workers find their control connections closed (they leave: worker/control.py);
* an agent hosting ranks and silent for :data:`OVERDUE_BEATS` beats (2.5 s at most) is *overdue*: the hang
  rule blames no rank meanwhile (controller/server.py). Its ranks, and every rank waiting for them, look
  silent alike, and with the vote-less commit a rank still waiting in an earlier step's reduction looks
  behind its peers: the node's loss, at T, is the fault (a frozen node's victim was once killed for it).

:class:`Liveness` is the controller's bookkeeping; it takes the clock as an argument (tested
without threads). Used under the controller's lock, or by the one thread that owns it.
"""

from __future__ import annotations

from collections.abc import Iterable

#: The beat interval and the agent's fencing point, as fractions of --node-timeout-s; a beat at least
#: every BEAT_MAX_S, so that an agent silent for OVERDUE_BEATS beats is seen within a few seconds whatever
#: the node timeout: the hang rule then waits for that node's fate instead of blaming one of its victims.
BEAT_FRACTION = 0.2
BEAT_MAX_S = 1.0
OVERDUE_BEATS = 2.5
FENCE_FRACTION = 0.5
#: --node-timeout-s by default: long enough for a loaded node's scheduler hiccups, short enough
#: that a frozen node costs less than a gloo timeout (FACTS.md: keep those 30-60 s).
DEFAULT_NODE_TIMEOUT_S = 30.0


def beat_interval_s(timeout_s: float) -> float:
    return min(timeout_s * BEAT_FRACTION, BEAT_MAX_S)


def fence_after_s(timeout_s: float) -> float:
    """How long an agent waits without a word from the controller before it stops its workers."""
    return timeout_s * FENCE_FRACTION


class Liveness:
    """When each agent (by agent id) was last heard; which are silent past the timeout."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._heard: dict[int, float] = {}
        self._next_beat_t = 0.0

    def heard(self, agent: int, now: float) -> None:
        self._heard[agent] = now

    def forget(self, agent: int) -> float | None:
        """Stop watching ``agent`` (its connection is gone); when it was last heard."""
        return self._heard.pop(agent, None)

    def silent(self, now: float) -> list[tuple[int, float]]:
        """(agent, seconds since its last message) of every agent silent longer than the timeout."""
        return sorted((a, now - t) for a, t in self._heard.items() if now - t > self.timeout_s)

    def overdue(self, now: float, agents: Iterable[int]) -> list[int]:
        """Those of ``agents`` silent for more than OVERDUE_BEATS beats (frozen, cut off, or about to be
        declared lost): their ranks' silence says nothing of who hangs."""
        after_s = OVERDUE_BEATS * beat_interval_s(self.timeout_s)
        return sorted(a for a in agents if a in self._heard and now - self._heard[a] > after_s)

    def beat_due(self, now: float) -> bool:
        """True once per beat interval: time to send every agent a heartbeat."""
        if now < self._next_beat_t:
            return False
        self._next_beat_t = now + beat_interval_s(self.timeout_s)
        return True
