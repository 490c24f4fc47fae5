"""Abortable works: what a :class:`~unbroken.parallel.group.SurvivingGroup` hands its callers.

An :class:`AbortableWork` wraps a backend's work: its ``wait()`` blocks in the backend work's
own timed ``wait`` (no polling sleep, no thread) and asks the job's :class:`AbortSignal` between
slices; its future (built only when asked for) is failed at once when the signal fires; the
backend work it gave up on goes to the fabric's graveyard (kept referenced until it ends, never
destroyed early). gloo's point-to-point works complete only inside ``wait()``, so a
:class:`ThreadWaitedWork` waits for one in a daemon thread and the timed wait asks it.

Used in the training thread of one rank; a future may be completed from a gloo worker thread
or the thread that fires the abort signal.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from unbroken.errors import CollectiveAborted, UnbrokenError


WAIT_SLICE = timedelta(milliseconds=5)  # how often a blocked wait asks the abort signal: the abort latency


def _unwrap(trigger: Future) -> Any:
    value, error = trigger.value()
    if error is not None:
        raise error
    return value


def lost_peer_error(signal: AbortSignal, what: str, err: BaseException) -> BaseException:
    """What a backend op that failed on a lost peer ends with: its error with the note the session
    recognizes, unless the abort order is out too (then the order is the root cause, as in
    :func:`~unbroken.comm.wait.wait_all`)."""
    if signal.is_set():
        aborted = CollectiveAborted(f"{what} aborted on the abort order; it had failed: {err}")
        aborted.__cause__ = err
        return aborted
    err.add_note(f"unbroken: during the {what}")
    return err


class DetachedCollective(UnbrokenError):
    """A reduction was issued on a :class:`SurvivingGroup` that has not joined a generation."""


class AbortSignal:
    """The abort order of one job as seen by one process: set once per generation.

    ``fire()`` may be called from any thread (a control-plane thread, a store watcher); it
    fails the future of every collective still pending. ``is_set()`` is what polling waits ask.
    ``clear()`` is called by the fabric when the next generation is attached.
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._pending: set[AbortableWork] = set()
        self.reason = ""
        self.failed = False  # a collective of this generation failed or was aborted (cleared by clear())

    def is_set(self) -> bool:
        return self._event.is_set()

    def fire(self, reason: str) -> None:
        with self._lock:
            self.reason = reason
            self._event.set()
            pending, self._pending = self._pending, set()
        for work in pending:
            work._fail(CollectiveAborted(f"collective aborted on the abort order ({reason})"))

    def clear(self) -> None:
        with self._lock:
            self._event.clear()
            self.reason = ""
            self.failed = False

    def _track(self, work: AbortableWork) -> bool:
        """Register ``work``; False when the signal is already set (the caller fails it)."""
        with self._lock:
            if self._event.is_set():
                return False
            self._pending.add(work)
            return True

    def _untrack(self, work: AbortableWork) -> None:
        with self._lock:
            self._pending.discard(work)


class AbortableWork(dist.Work):
    """One collective on the current generation's backend, left at once on an abort order.

    The fast path adds no thread and no polling sleep: ``wait()`` blocks in the backend work's
    own ``wait`` (woken by gloo the moment the op ends) in slices of :data:`WAIT_SLICE`, asking
    the abort signal between slices; ``get_future()`` (what DDP's reducer waits on) returns a
    future completed by the backend's own future or failed by :meth:`AbortSignal.fire`,
    whichever comes first. The future and its callback are built only when asked for (an
    FSDP2 all-gather is only waited on). A backend work given up on goes to ``graveyard``.
    """

    def __init__(self, inner: dist.Work | None, signal: AbortSignal, graveyard: list[Any], what: str,
                 result: Any = None, finish: Callable[[], Any] | None = None) -> None:
        super().__init__()
        self._inner, self._signal, self._graveyard, self._what = inner, signal, graveyard, what
        self._finish = finish  # run once the backend work succeeded; its return value is the result
        self._lock = threading.Lock()  # completion may race: the training thread, a gloo thread, fire()
        self._completed = self._finishing = False
        self._value: Any = None
        self._error: BaseException | None = None
        self._trigger: Future | None = None  # built by get_future()
        self._future: Future | None = None
        if inner is None:  # completed locally (a detached group)
            self._complete(result, None)
        elif signal.is_set():
            self._fail(CollectiveAborted(f"{what} issued after the abort order ({signal.reason})"))

    def _complete(self, value: Any, error: BaseException | None) -> bool:
        with self._lock:
            if self._completed:
                return False
            self._completed, self._value, self._error = True, value, error
            trigger = self._trigger
        if trigger is not None:
            self._signal._untrack(self)
            trigger.set_result((value, error))
        return True

    def _inner_done(self, fut: Future) -> None:  # a gloo thread (only once get_future() was asked)
        try:
            value = fut.value()
        except Exception as err:  # noqa: BLE001 - a peer died: the op's error is the result
            self._fail(err)
            return
        self._succeed(value)

    def _succeed(self, value: Any) -> None:
        with self._lock:
            if self._completed or self._finishing:
                return  # the other path (wait or the future's callback) got there first
            self._finishing = True
        if self._finish is not None:
            try:
                value = self._finish()
            except Exception as err:  # noqa: BLE001 - e.g. a copy into a wrong-sized output
                self._fail(err)
                return
        self._complete(value, None)

    def _fail(self, err: BaseException) -> None:
        # Seen through C++ (DDP's reducer) the error is a plain RuntimeError: the flag is how
        # the session tells a collective lost to a fault from a bug of the script's.
        self._signal.failed = True
        inner_pending = self._inner is not None and not self._inner.is_completed()
        if self._complete(None, err) and inner_pending:
            self._graveyard.append(self._inner)  # never dropped early: FACTS.md

    def is_completed(self) -> bool:
        if not self._completed and self._inner is not None and self._inner.is_completed():
            self._settle()
        return self._completed

    def _settle(self) -> None:
        """The backend work ended (seen by polling or by a wait slice): take its result or error."""
        try:
            self._inner.wait()
            value = self._inner_value()
        except Exception as err:  # noqa: BLE001 - the op's error is the result
            self._failed_op(err)
            return
        self._succeed(value)

    def _failed_op(self, err: BaseException) -> None:
        """The backend op raised (a peer died)."""
        self._fail(lost_peer_error(self._signal, self._what, err))

    def _inner_value(self) -> Any:
        try:  # the future's value: Work.result() is deprecated (it warns once per process)
            return self._inner.get_future().value()
        except RuntimeError:  # works with no future (gloo's _allgather_base)
            return self._inner.result()

    def is_success(self) -> bool:
        return self._completed and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def wait(self, timeout: Any = None) -> bool:
        inner, signal = self._inner, self._signal
        while not self._completed:
            if signal.is_set():  # asked first: every rank that saw the order aborts the same step
                self._fail(CollectiveAborted(
                    f"{self._what} aborted on the abort order ({signal.reason}); the backend op stays "
                    "referenced until it ends (at the latest at the process-group timeout)"))
                break
            try:
                inner.wait(WAIT_SLICE)  # returns the moment the op ends; raises when the slice runs out
            except Exception:  # noqa: BLE001 - the slice ran out, or the op failed
                if not inner.is_completed():
                    continue
            self._settle()  # it ended (the slice may have run out just as it did): its result or error
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> Future:
        """The future torch's C++ callers (DDP's reducer) wait on: built on the first call."""
        if self._future is not None:
            return self._future
        # A Future completed from Python with set_exception() is, to C++ callers (DDP's
        # reducer), a *successful* future holding an exception object; only a callback that
        # raises marks a future failed. So ours is a `then` of a trigger that carries
        # (value, error), and the callback raises the error.
        trigger = Future()
        future = trigger.then(_unwrap)
        with self._lock:
            self._trigger, self._future, done = trigger, future, self._completed
        if done:
            trigger.set_result((self._value, self._error))
        elif not self._signal._track(self):
            self._fail(CollectiveAborted(f"{self._what} aborted on the abort order ({self._signal.reason})"))
        else:
            try:
                inner_future = self._inner.get_future()
            except RuntimeError:  # gloo's _allgather_base/_reduce_scatter_base works have none:
                return future     # they complete through wait() / is_completed()
            inner_future.add_done_callback(self._inner_done)
        return future

    def result(self) -> Any:
        self.wait()
        return self._value


class ThreadWaitedWork(dist.Work):
    """A gloo send/recv work, waited on by a daemon thread so that it can be polled.

    gloo's send and recv works complete only inside ``wait()``: ``is_completed()`` stays False
    until then (torch 2.13), so a polling wait on them never ends. The thread waits (until the
    op ends or fails, at the latest at the backend's timeout, keeping the work referenced that
    long: FACTS.md); :meth:`is_completed` reports what it saw. No future (like gloo's own).
    """

    def __init__(self, inner: dist.Work, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self._inner, self._tensors = inner, tensors
        self._error: BaseException | None = None
        self._done = threading.Event()
        threading.Thread(target=self._run, daemon=True, name="unbroken-p2p-wait").start()

    def _run(self) -> None:
        try:
            self._inner.wait()
        except Exception as exc:  # noqa: BLE001 - re-raised by wait() in the caller's thread
            self._error = exc
        finally:
            self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Like a gloo work's: ``timeout`` (none or zero: no limit) raises ``RuntimeError`` when it
        runs out before the op ended (the op goes on)."""
        limit_s = timeout.total_seconds() if timeout else None
        if not self._done.wait(limit_s):
            raise RuntimeError("Operation timed out!")
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> Future:
        raise RuntimeError("a point-to-point work has no future: it completes through wait()")

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._tensors
