"""Node liveness: heartbeats both ways between the controller and every agent, and the timing rules.

A node whose processes are frozen (SIGSTOP, a kernel stall) or whose link is cut keeps its TCP
connections open: nothing closes and nothing errors, silence is the only sign. So, under
``--node-timeout-s T``:

* the controller and every agent each send a ``Heartbeat`` every :func:`beat_interval_s` (T / 5);
  any message counts as one;
* the controller declares an agent lost after T without a message from it: it closes that agent's
  connection and its workers' (a frozen node that wakes up finds them closed), and the node's ranks
  take the recovery ladder as a lost node (``agent_lost`` with ``silent_s``);
* an agent that heard nothing from the controller for :func:`fence_after_s` (T / 2) kills its own
  workers and exits (agent/agent.py): fencing. Both silences start with the same cut, and the
  controller's beats come every T / 5, so the node has fenced itself at least 0.3 T before the
  controller can declare it lost and hand its ranks to another node: nobody trains on a generation
  it no longer belongs to. A frozen node cannot fence itself; when it wakes, its agent fences at
  once and its workers find their control connections closed (they leave: worker/control.py).

:class:`Liveness` is the controller's bookkeeping; it takes the clock as an argument (tested
without threads). Used under the controller's lock, or by the one thread that owns it.
"""

from __future__ import annotations

#: The beat interval and the agent's fencing point, as fractions of --node-timeout-s.
BEAT_FRACTION = 0.2
FENCE_FRACTION = 0.5
#: --node-timeout-s by default: long enough for a loaded node's scheduler hiccups, short enough
#: that a frozen node costs less than a gloo timeout (FACTS.md: keep those 30-60 s).
DEFAULT_NODE_TIMEOUT_S = 30.0


def beat_interval_s(timeout_s: float) -> float:
    return timeout_s * BEAT_FRACTION


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

    def beat_due(self, now: float) -> bool:
        """True once per beat interval: time to send every agent a heartbeat."""
        if now < self._next_beat_t:
            return False
        self._next_beat_t = now + beat_interval_s(self.timeout_s)
        return True
