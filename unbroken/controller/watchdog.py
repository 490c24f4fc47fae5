"""The controller's watchdog over live ranks: step times, the hang rule and the straggler rule.

(Not the live view of a job for operators: that is :mod:`unbroken.ops.live_view`.)

Owned by the :class:`~unbroken.controller.server.Controller`; its methods run under the
controller's lock, from the connection threads (completed steps) and from the watchdog
thread (:meth:`Watchdog.find_hung` while running, :meth:`Watchdog.find_silent_in_recovery`
during an in-flight recovery, every ``WATCH_INTERVAL_S``). It reads the ranks' views and
changes none of them (the :class:`~unbroken.controller.board.Board` does). No I/O: it answers,
the controller acts; who is blamed for a hang is the pure rule of :mod:`unbroken.controller.hangs`.
"""

from __future__ import annotations

import dataclasses

import statistics
from collections import deque
from collections.abc import Iterable, Mapping

from unbroken.config import HangConfig
from unbroken.controller import hangs, health
from unbroken.controller.api import Recovery
from unbroken.controller.views import RankView
from unbroken.names import LIVE_WORKER_STATES, WorkerState

WATCH_INTERVAL_S = 0.1
_NONE: Mapping[int, float] = {}


class Watchdog:
    """Step times of the job (for the hang timeout), and the ranks reported as stragglers."""

    def __init__(self, hang: HangConfig, straggler_factor: float) -> None:
        self._hang = hang
        self._straggler_factor = straggler_factor
        self._step_times: deque[float] = deque(maxlen=200)
        self._p99: float | None = None  # p99_step_s of _step_times, kept until a new time comes
        self._stragglers: set[int] = set()  # ranks the straggler rule reported (once per job)

    def median_step_s(self) -> float | None:
        return statistics.median(self._step_times) if self._step_times else None

    def p99_step_s(self) -> float | None:
        """The 99th percentile of the recent steady step times (the largest, below 100 of them); sorted
        once per new time, not once per rank a watchdog tick looks at."""
        if self._p99 is None and self._step_times:
            times = sorted(self._step_times)
            self._p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
        return self._p99

    def hang_timeout_s(self, w: RankView) -> float:
        """``--first-step-timeout-s`` for a rank's first step of its attempt and the first step after an
        in-flight recovery (every rank of the new generation: its peers wait in the redo step's first
        collective for the replacement's first step and its new connections); else the calibrated one."""
        if w.steps_in_generation == 0:
            return self._hang.first_step_timeout_s
        return self.steady_timeout_s()

    def steady_timeout_s(self) -> float:
        """``--hang-timeout-s``, else the one calibrated from step times, for a rank with no evidence
        against it (every rank silent alike). Also the timeout after a rank's loop and before its first
        step for a stopped process (counted from when its agent saw it so)."""
        return self._calibrated(self._hang.floor_s)

    def evidence_timeout_s(self) -> float:
        """``--hang-timeout-s``, else the calibrated timeout of a steady rank with evidence against it:
        its process stopped or a zombie, or it has not reached the step's collective while every other
        rank waits there (:meth:`progress`). ``max(1 s, 3 x p99 step)`` by default."""
        return self._calibrated(self._hang.evidence_floor_s)

    def stopped_timeout_s(self) -> float:
        """``--hang-timeout-s``, else ``stopped_s``: a rank whose process is stopped (or a zombie) while
        no other rank is behind it (see :meth:`progress` and :class:`~unbroken.config.HangConfig`)."""
        hang = self._hang
        return hang.timeout_s if hang.timeout_s is not None else hang.stopped_s

    def _calibrated(self, floor_s: float) -> float:
        hang = self._hang
        if hang.timeout_s is not None:
            return hang.timeout_s
        return max(floor_s, hang.factor * (self.p99_step_s() or 0.0))

    def note_step_s(self, seconds: float) -> None:
        """A rank took ``seconds`` for a steady step (not its first of a generation): the times the
        calibrated hang timeouts scale with."""
        self._step_times.append(seconds)
        self._p99 = None

    def progress(self, workers: Iterable[RankView], attempt: int, now: float,
                 since_t: float | None = None, heard: Mapping[int, float] = _NONE) -> list[hangs.RankProgress]:
        """Every live rank of ``attempt``, silent since its last step (or since ``since_t``); under node
        summaries, since its node last said all its ranks reported (``heard``: agent -> then), if later.

        The timeout of each is :meth:`hang_timeout_s`, shortened to :meth:`evidence_timeout_s` for a
        steady rank with evidence against it (see :class:`~unbroken.config.HangConfig`). A rank whose
        process is stopped or a zombie counts instead as silent since its agent saw it so, where that
        is the further past its timeout (before its first step, where the first-step timeout would
        leave a stopped process alone for a minute); one stopped while no other rank is behind it (each
        waits in a collective, or is at or past its step and phase: it will wait there) gets
        :meth:`stopped_timeout_s`."""
        live = [w for w in workers if w.attempt == attempt and w.state in LIVE_WORKER_STATES]
        seen = [hangs.RankProgress(w.rank, w.phase, now - (_heard_t(w, heard) if since_t is None else since_t),
                                   self.hang_timeout_s(w), w.process, _step(w)) for w in live]
        where = hangs.front(seen)
        waiting = sum(hangs.at_front(r, where) for r in seen)
        rearmost = min((r.position for r in seen if r.phase not in hangs.WAITING), default=None)  # not waiting
        ranks = []
        for w, rank in zip(live, seen):
            steady = w.steps_in_generation > 0 and since_t is None and len(live) > 1
            others_wait = steady and waiting == len(live) - 1 and not hangs.at_front(rank, where)
            if others_wait:  # every peer waits for this one
                rank = dataclasses.replace(rank, timeout_s=min(rank.timeout_s, self.evidence_timeout_s()))
            if w.process in hangs.NOT_RUNNING:
                nobody_behind = rearmost is None or rearmost >= rank.position
                if steady and nobody_behind:  # it cannot progress; the others cannot without it
                    after_s = self.stopped_timeout_s()
                else:
                    after_s = self.evidence_timeout_s() if w.steps_in_generation > 0 else self.steady_timeout_s()
                stopped = _since_seen(w, now, after_s)
                if stopped.silent_s - stopped.timeout_s > rank.silent_s - rank.timeout_s:
                    rank = stopped
            ranks.append(rank)
        return ranks

    def find_hung(self, workers: Iterable[RankView], attempt: int, now: float,
                  heard: Mapping[int, float] = _NONE) -> tuple[hangs.RankProgress, str] | None:
        """The rank to blame for a hang and the evidence, once some rank of ``attempt`` is past
        its hang timeout. Who is blamed is decided among all live ranks (:mod:`.hangs`): the
        ranks blocked in the collective are usually waiting for the one that is not progressing.

        Step progress is expected only of a job that runs an unbroken step loop: until some rank
        of the attempt entered ``job.steps()``, only the agent's evidence counts (a plain torchrun
        script, or one that called ``unbroken.init()`` only, reports no steps): a rank whose process
        has been stopped or a zombie for ``--first-step-timeout-s``. Once one has, a rank that has
        not entered it yet is judged by ``--first-step-timeout-s``, and a stopped one by the steady
        timeout from when it was seen stopped (see :meth:`progress`).
        """
        workers = [w for w in workers if w.attempt == attempt]
        if not self._any_due(workers, now, heard):
            return None
        if not any(w.in_step_loop for w in workers):
            first = self._hang.first_step_timeout_s
            ranks = [_since_seen(w, now, first) for w in workers
                     if w.state in LIVE_WORKER_STATES and w.process in hangs.NOT_RUNNING]
        else:
            ranks = self.progress(workers, attempt, now, heard=heard)
        blamed = hangs.blame_hang(ranks)
        return None if blamed is None else (blamed, hangs.why(blamed, ranks))

    def _any_due(self, workers: list[RankView], now: float, heard: Mapping[int, float]) -> bool:
        """False when no rank can be past its hang timeout now: every live process runs and the longest
        silence is within the shortest timeout any running rank gets (:meth:`progress`). The common case
        of every tick, answered in one pass instead of the rules' several (16k ranks: ms, not 100s of ms)."""
        oldest_t = now
        for w in workers:
            if w.state in LIVE_WORKER_STATES:
                if w.process in hangs.NOT_RUNNING:
                    return True
                oldest_t = min(oldest_t, _heard_t(w, heard))
        shortest = min(self._hang.first_step_timeout_s, self.steady_timeout_s(), self.evidence_timeout_s())
        return now - oldest_t > shortest

    def find_silent_in_recovery(self, workers: Iterable[RankView], attempt: int, rec: Recovery,
                                ordered_t: float, now: float) -> hangs.RankProgress | None:
        """A survivor of recovery ``rec`` that has not answered its abort order (given at
        ``ordered_t``) within its hang timeout; the replaced ranks are not asked."""
        ranks = [r for r in self.progress(workers, attempt, now, since_t=ordered_t) if r.rank not in rec.replaced]
        return hangs.silent_in_recovery(ranks, rec.paused)

    def find_hung_after_loop(self, workers: Iterable[RankView], attempt: int, now: float,
                             killed: Iterable[int] = ()) -> hangs.RankProgress | None:
        """A rank of ``attempt`` past its step loop (it reported ``finished``, has not exited; not one
        of ``killed`` already) whose process its agent has seen stopped or a zombie for longer than
        its hang timeout."""
        skip = set(killed)
        timeout_s = self.steady_timeout_s()
        ranks = [_since_seen(w, now, timeout_s) for w in workers
                 if w.attempt == attempt and w.state is WorkerState.FINISHING and w.rank not in skip]
        return hangs.hung_after_loop(ranks)

    def find_lingering_after_loop(self, workers: Iterable[RankView], attempt: int, now: float,
                                  killed: Iterable[int] = ()) -> hangs.RankProgress | None:
        """A rank of ``attempt`` past its step loop whose process still runs ``--exit-timeout-s`` after
        the last rank that exited by itself (not one of ``killed``), once every rank left its loop and
        some exited; the lowest such rank. Before that, some rank still trains: nothing lingers."""
        workers, skip = [w for w in workers if w.attempt == attempt], set(killed)
        lingering = [w for w in workers if w.state is WorkerState.FINISHING and w.rank not in skip]
        ended = [w.exited_t for w in workers if w.exited_t is not None and w.rank not in skip]
        if not lingering or not ended or any(w.exited_t is None and w.state is not WorkerState.FINISHING
                                             for w in workers):
            return None
        w = min(lingering, key=lambda v: v.rank)
        return hangs.lingering_after_loop(
            hangs.RankProgress(w.rank, w.phase, now - max(ended), self._hang.exit_timeout_s, w.process))

    def new_stragglers(self, workers: Iterable[RankView]) -> list[tuple[int, str]]:
        """(rank, why) of ranks the straggler rule (``--straggler-factor``) finds slow, each once."""
        timings = {w.rank: w.compute_s for w in workers}
        return [(rank, health.describe(median_s, job_s))
                for rank, median_s, job_s in health.stragglers(timings, self._straggler_factor)
                if self.first_straggle(rank)]

    def first_straggle(self, rank: int) -> bool:
        """True the first time ``rank`` is found a straggler: each is reported once per job."""
        if rank in self._stragglers:
            return False
        self._stragglers.add(rank)
        return True


def _heard_t(w: RankView, heard: Mapping[int, float]) -> float:
    """When ``w`` was last heard progressing: its own last report, or its node's summary (``heard``) if later."""
    return max(w.last_progress_t, heard.get(w.agent, w.last_progress_t)) if heard else w.last_progress_t


def _since_seen(w: RankView, now: float, timeout_s: float) -> hangs.RankProgress:
    """``w`` as silent since its agent last reported its process state (stopped, a zombie)."""
    return hangs.RankProgress(w.rank, w.phase, now - w.process_t, timeout_s, w.process, _step(w))


def _step(w: RankView) -> int:
    return -1 if w.step is None else w.step

