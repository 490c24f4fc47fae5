"""An agent's watch on its controller: heartbeats out, and fencing when the controller goes silent.

Owned by one :class:`~unbroken.agent.agent.Agent`; one thread of its own. Every beat interval it
sends a ``Heartbeat``; when nothing came from the controller for ``fence_after_s`` (the rules:
:mod:`unbroken.controller.liveness`) it calls ``fence`` once, with the seconds of silence, and
ends. The agent's command loop calls :meth:`heard` on every message it receives.

The silence is checked before each send: a send into a cut link may block once the socket's
buffer is full, and the fence must not wait behind it.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from unbroken.controller.liveness import beat_interval_s, fence_after_s
from unbroken.protocol import messages as m

POLL_S = 0.05


class ControllerWatch:
    """Heartbeats to the controller and the fencing deadline (see the module docstring)."""

    def __init__(self, node_rank: int, timeout_s: float, send: Callable[[m.Message], bool],
                 fence: Callable[[float], None]) -> None:
        self._node_rank = node_rank
        self._beat_s = beat_interval_s(timeout_s)
        self._fence_s = fence_after_s(timeout_s)
        self._send, self._fence = send, fence
        self._heard_t = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="unbroken-agent-fence", daemon=True)

    @property
    def fence_after_s(self) -> float:
        return self._fence_s

    def heard(self) -> None:
        self._heard_t = time.monotonic()

    def start(self) -> None:
        self.heard()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        next_beat_t = time.monotonic()
        while not self._stop.wait(POLL_S):
            now = time.monotonic()
            silent_s = now - self._heard_t
            if silent_s > self._fence_s:
                self._fence(silent_s)
                return
            if now >= next_beat_t:
                next_beat_t = now + self._beat_s
                # The agent's id stands in the rank field (controller-side it is the connection's anyway).
                self._send(m.Heartbeat(rank=self._node_rank))
