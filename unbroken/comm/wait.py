"""Waiting on collectives without ever blocking past an abort order (DESIGN.md section 6).

Nothing in torch cancels an in-flight gloo op (FACTS.md): a blocked ``work.wait()`` only
ends at the process-group timeout. So collectives are issued with ``async_op=True`` and
the training thread waits for ``work`` while also asking the caller's abort check. With an
:class:`AbortWatch` (a check that the thread learning of an abort also *wakes*) and works that
say when they end (a gloo collective's future, :class:`Completion`), the wait blocks: it
wakes on a work's end or on the abort, never on a timer (a backstop of ``BACKSTOP_S``
only). Otherwise it polls ``work.is_completed()`` with short sleeps. Why blocking matters:
during a recovery the survivors wait for the replacement; N - 1 ranks polling every 2 ms
took CPU from the few ranks doing the work (docs/scale.md). On abort the pending work
objects are handed to a graveyard list that the caller owns: dropping them early would
block in their destructor until the timeout.

Runs in the training thread of one rank; :meth:`AbortWatch.wake` and the works' callbacks run
in other threads (the control reader, gloo's worker threads).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from collections.abc import Callable, Sequence
from typing import Protocol

from torch.distributed import Work

from unbroken.errors import CollectiveAborted

AbortCheck = Callable[[], bool]

_FIRST_SLEEP_S = 50e-6  # short first: a small bucket is done in ~0.3 ms
_MAX_SLEEP_S = 2e-3     # the abort latency bound; polling faster only burns a core gloo needs
BACKSTOP_S = 0.1        # a blocked wait re-checks everything this often even if nothing woke it
BRIEF_WAIT_S = 0.02     # how long a wait first blocks in torch's own timed waits (_wait_briefly)
BRIEF_SLICE = timedelta(milliseconds=5)  # ... in slices of this: the abort latency while it does


class AbortWatch:
    """An abort check that can also wake the waits blocked on it.

    Owned by one rank's in-flight state (:class:`~unbroken.worker.inflight.InFlight`).
    ``watch()`` asks the check (the training thread); :meth:`wake` is called by whichever thread
    learns of an abort (the control reader thread) *after* the check would return True, and
    wakes every wait registered now.
    """

    def __init__(self, check: AbortCheck) -> None:
        self._check = check
        self._lock = threading.Lock()
        self._waiters: set[threading.Event] = set()

    def __call__(self) -> bool:
        return self._check()

    def wake(self) -> None:
        with self._lock:
            waiters = list(self._waiters)
        for event in waiters:
            event.set()

    def _add(self, event: threading.Event) -> None:
        with self._lock:
            self._waiters.add(event)

    def _discard(self, event: threading.Event) -> None:
        with self._lock:
            self._waiters.discard(event)


class Completion(Protocol):
    """A work that calls ``fn()`` (from any thread) once it ended, successfully or not."""

    def on_done(self, fn: Callable[[], None]) -> None: ...


def _hook(work: object, fn: Callable[[], None]) -> bool:
    """Make ``fn()`` run when ``work`` ends; False if it cannot say (then the wait polls). A plain
    torch work tells through its future (gloo completes it, error or not, a moment *before*
    ``is_completed()`` turns True: so the hook, not ``is_completed``, says it ended); gloo's
    reduce-scatter and send/recv works have none."""
    if hasattr(work, "on_done"):
        work.on_done(fn)
        return True
    if type(work) is not Work:  # a Python subclass (parallel/work.py) may complete only in wait()
        return False
    try:
        future = work.get_future()
    except RuntimeError:
        return False
    future.add_done_callback(lambda _f: fn())
    return True


def wait_all(works: Sequence[Work], should_abort: AbortCheck | None, graveyard: list[Work],
             what: str) -> None:
    """Wait until every work in ``works`` completed; raise if one failed or on abort.

    ``what`` names the operation for messages (e.g. "gradient all-reduce of step 7").
    Raises :class:`CollectiveAborted` when ``should_abort()`` returns True before all
    works were seen complete (it is asked before each poll, so a step waited on after the
    order went out always aborts); the works not yet completed go to ``graveyard``. A
    work that fails (a peer died) re-raises its torch error with a note, unless the abort
    check also says abort: then it is :class:`CollectiveAborted`, the order being the root
    cause. Without ``should_abort`` it simply waits (blocking) on each work in turn.
    """
    if should_abort is None:
        _wait_blocking(works, graveyard, what)
        return
    if isinstance(should_abort, AbortWatch):
        works = _wait_briefly(works, should_abort, graveyard, what)
        if not works or _wait_woken(works, should_abort, graveyard, what):
            return
    pending = list(works)
    sleep_s = _FIRST_SLEEP_S
    while pending:
        # The abort order is checked first, so every rank that sees it aborts the same
        # step, even where its own ops happened to finish.
        if should_abort():
            graveyard.extend(w for w in pending if not w.is_completed())
            raise _aborted(what, len(pending), len(works))
        still = []
        for index, work in enumerate(pending):
            if not work.is_completed():
                still.append(work)
                continue
            _take_outcome(work, [*pending[index + 1:], *still], should_abort, graveyard, what)
        pending = still
        if pending:
            time.sleep(sleep_s)
            sleep_s = min(sleep_s * 2, _MAX_SLEEP_S)


def _take_outcome(work: Work, rest: Sequence[Work], should_abort: AbortCheck, graveyard: list[Work],
                  what: str) -> None:
    """The outcome of ``work``, which ended: nothing if it succeeded; if it failed, the works in ``rest``
    still pending go to ``graveyard`` and its error is raised with a note naming ``what``, or as
    CollectiveAborted when the abort order came too (the order being the root cause)."""
    try:
        work.wait()  # it ended: returns at once, or raises the op's error
    except Exception as err:  # noqa: BLE001 - any backend error ends the op
        graveyard.extend(w for w in rest if not w.is_completed())
        if should_abort():
            raise CollectiveAborted(f"{what} aborted on the abort order; it had failed: {err}") from err
        err.add_note(f"unbroken: during the {what}")
        raise


def _aborted(what: str, pending: int, total: int) -> CollectiveAborted:
    return CollectiveAborted(
        f"{what} aborted on the abort order with {pending} of {total} collective "
        "op(s) not yet seen complete; pending ones stay referenced in `abandoned_work` "
        "until they end (at the latest at the process-group timeout)")


def _wait_briefly(works: Sequence[Work], watch: AbortWatch, graveyard: list[Work], what: str) -> list[Work]:
    """:func:`wait_all` for up to ``BRIEF_WAIT_S``, in torch's own timed waits of ``BRIEF_SLICE`` (asking
    ``watch`` between them); returns the works still pending. Why: a steady step's collective ends within
    milliseconds, and waking a Python thread from gloo's (a future's callback, an event) cost 0.35 ms per
    all-reduce of 4 ranks on 2 cores (docs/scale.md); the woken wait takes over for longer waits."""
    deadline = time.monotonic() + BRIEF_WAIT_S
    for index, work in enumerate(works):
        if type(work) is not Work:  # a Python subclass (parallel/work.py) may not take a timeout
            return list(works[index:])
        while True:
            if watch():  # first, as in the other waits: every rank that saw the order aborts the same step
                graveyard.extend(w for w in works[index:] if not w.is_completed())
                raise _aborted(what, len(works) - index, len(works))
            try:
                work.wait(BRIEF_SLICE)
                break
            except Exception:  # noqa: BLE001 - the slice ran out (perhaps just as the op ended), or the op failed
                if work.is_completed():
                    break  # its outcome, success or the op's own error, is taken below
            if time.monotonic() >= deadline:
                return list(works[index:])
        _take_outcome(work, works[index + 1:], watch, graveyard, what)
    return []


def _wait_woken(works: Sequence[Work], watch: AbortWatch, graveyard: list[Work], what: str) -> bool:
    """:func:`wait_all` blocking on ``wake`` (see the module docstring); False, having waited for
    nothing, when a work cannot say when it ends (the caller then polls)."""
    wake = threading.Event()
    ended = [threading.Event() for _ in works]

    def done(event: threading.Event) -> Callable[[], None]:
        return lambda: (event.set(), wake.set())

    if not all(_hook(work, done(event)) for work, event in zip(works, ended)):
        return False  # the hooks already set stay harmless: they set events nobody waits on
    watch._add(wake)
    try:
        pending = list(range(len(works)))
        while pending:
            wake.clear()  # cleared before the checks: a wake after them is never lost
            if watch():  # first, as in the polling loop: every rank that saw the order aborts the same step
                graveyard.extend(works[i] for i in pending if not works[i].is_completed())
                raise _aborted(what, len(pending), len(works))
            still = []
            for n, i in enumerate(pending):
                if not ended[i].is_set():
                    still.append(i)
                    continue
                _take_outcome(works[i], [works[j] for j in [*still, *pending[n + 1:]]], watch, graveyard, what)
            pending = still
            if pending:
                wake.wait(BACKSTOP_S)
    finally:
        watch._discard(wake)
    return True


def _wait_blocking(works: Sequence[Work], graveyard: list[Work], what: str) -> None:
    for index, work in enumerate(works):
        try:
            work.wait()
        except Exception as err:  # noqa: BLE001
            graveyard.extend(w for w in works[index + 1:] if not w.is_completed())
            err.add_note(f"unbroken: during the {what}")
            raise
