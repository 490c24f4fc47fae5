"""What the controller hears of one rank's steps, with as few messages as the rules allow.

A step used to cost five reports (progress at compute, sync, update and done, then
StepSynced). Two carry what the controller needs every step:

* the **compute** report at the step's start carries the rank's step-start state and, folded
  into it (``done=True``), the previous step's completion and metrics: nothing of the session
  runs between one step's end and the next one's start, so the fold delays it by microseconds;
* **StepSynced** (worker/control.py), sent as the rank joins the step's commit vote, tells the
  controller the rank finished its reduction and waits in the vote (phase ``vote``), with its
  state after compute; the controller records the step committed once every rank sent it. A step
  committed without a vote whose state after compute is in node memory (worker/commit.py,
  checkpoint/own_state.py) sends none: its ``done``, folded into the next compute report, says
  ``synced`` instead, so such a step costs one report.

The in-step marks (``sync`` when a collective starts, ``update``) travel only when a rank
*stays* in that phase for ``MARK_DELAY_S`` (0.5 s): what the hang rule needs is who waits inside the
collective when a hang timeout (seconds) runs out, and a rank blocked there for long has
reported it by then. A completed step whose report found no compute report to ride on is sent
alone after the same delay (a safety net: every path out of the loop flushes it earlier).

Owned by one :class:`~unbroken.worker.control.ControlClient`. ``phase``/``done``/``send_now``
run in the training thread, ``flush_due`` in the client's heartbeat thread; one lock orders
them, so a late mark can never overtake the report that supersedes it on the wire.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from unbroken.names import Phase
from unbroken.protocol import messages as m

#: How long a rank stays in ``sync`` or ``update`` before that mark is sent to the controller.
#: Well below any hang timeout (>= 5 s unless fixed lower): ranks blocked in the collective by a
#: hung peer have waited there most of that timeout when it runs out. At 0.1 s, 16 ranks on 2
#: cores (190 ms steps) still sent 4 messages per rank per step: their phases last that long.
MARK_DELAY_S = 0.5
#: Marks sent immediately: everything but the in-step ones.
DEFERRED_PHASES = (Phase.SYNC, Phase.UPDATE)


@dataclass
class _Pending:
    step: int
    phase: str
    since_t: float
    metrics: dict[str, Any] = field(default_factory=dict)
    work: Any = None  # a collective mark's work: the mark goes only while it has not completed
    synced: bool = False  # a completed step that committed without its commit report (Progress.synced)


class StepReports:
    """A rank's step reports to the controller (see the module docstring for which travel)."""

    def __init__(self, send: Callable[[m.Message], bool], *, rank: int, attempt: int,
                 delay_s: float = MARK_DELAY_S) -> None:
        self._send, self._rank, self._attempt, self._delay_s = send, rank, attempt, delay_s
        self._lock = threading.Lock()
        self._mark: _Pending | None = None  # an in-step mark not sent yet
        self._done: _Pending | None = None  # a completed step not reported yet
        self._compute_t: float | None = None  # when the step in flight began (for its compute_s)
        self._compute_s: float | None = None  # its compute time, up to its first collective
        self.sent = 0  # step reports sent (for tests and benchmarks)

    def phase(self, step: int, phase: str, state: bytes = b"", state_same: bool = False, moved: bool = False) -> None:
        """The rank entered ``phase`` of step ``step`` (``state``: its own state, with ``compute``; ``moved``:
        as Progress.moved)."""
        now = time.monotonic()
        with self._lock:
            if phase in DEFERRED_PHASES:
                if phase == Phase.SYNC and self._compute_t is not None:
                    self._compute_s = now - self._compute_t  # compute time, measured here: no sync report needed
                    self._compute_t = None
                self._mark = _Pending(step, phase, now)
                return
            self._mark = None
            done, metrics, synced = False, {}, False
            if phase == Phase.COMPUTE and self._done is not None and self._done.step == step:
                done, metrics, synced, self._done = True, self._done.metrics, self._done.synced, None
            self._flush_done_locked()
            self._compute_t = now if phase == Phase.COMPUTE else None
            self._progress(step, phase, metrics, state=state, state_same=state_same, done=done, synced=synced,
                           moved=moved)

    def collective(self, step: int, work: Any) -> None:
        """The rank issued a collective other than a reduction in its step's compute (``work``): marked
        ``collective`` if the rank still waits in it after the delay (no other mark supersedes one)."""
        with self._lock:
            if self._mark is None or self._mark.phase == Phase.COLLECTIVE:
                self._mark = _Pending(step, Phase.COLLECTIVE, time.monotonic(), work=work)

    def done(self, step: int, metrics: dict[str, Any], synced: bool = False) -> None:
        """The rank completed ``step`` steps (``synced``: as Progress.synced); the report rides on the next
        compute report."""
        metrics = dict(metrics)
        with self._lock:
            if self._compute_s is not None:
                metrics["compute_s"], self._compute_s = self._compute_s, None
            self._mark = None
            self._flush_done_locked()
            self._done = _Pending(step, Phase.DONE, time.monotonic(), metrics, synced=synced)

    def send_now(self, msg: m.Message) -> bool:
        """Send ``msg`` after any pending completed step; a pending mark is dropped (``msg`` supersedes it)."""
        with self._lock:
            self._mark = None
            self._flush_done_locked()
            return self._send(msg)

    def send_beside(self, msg: m.Message) -> bool:
        """Send ``msg`` after any pending completed step, keeping a pending mark (``msg`` is not a phase)."""
        with self._lock:
            self._flush_done_locked()
            return self._send(msg)

    def flush_due(self, now: float | None = None) -> None:
        """Send a mark (or a completed step) that has stood for the delay; from the heartbeat thread."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if self._done is not None and now - self._done.since_t >= self._delay_s:
                self._flush_done_locked()
            mark = self._mark
            if mark is not None and mark.work is not None and mark.work.is_completed():
                self._mark = mark = None  # it left that collective: not waiting there
            if mark is not None and now - mark.since_t >= self._delay_s:
                self._mark = None
                self._progress(mark.step, mark.phase, {})

    def flush(self) -> None:
        """Send what is pending now (before the connection closes)."""
        with self._lock:
            self._flush_done_locked()

    def _flush_done_locked(self) -> None:
        done, self._done = self._done, None
        if done is not None:
            self._progress(done.step, Phase.DONE, done.metrics, synced=done.synced)

    def _progress(self, step: int, phase: str, metrics: dict, **fields: Any) -> None:
        self.sent += 1
        self._send(m.Progress(rank=self._rank, attempt=self._attempt, step=step, phase=phase, metrics=metrics,
                              **fields))
