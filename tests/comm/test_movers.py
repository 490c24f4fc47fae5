"""The transfer first (comm/movers.py): a survivor in no move waits, blocked in the store, until
every mover of the generation marked itself done; an abort order, the timeout or a failed store
end the wait (it only orders the work, it never decides anything)."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from unbroken.comm import movers
from unbroken.controller.store_service import StoreService
from unbroken.errors import CollectiveAborted
from unbroken.protocol.wire import Server
from unbroken.recovery.transfer_plan import Move, movers as movers_in
from unbroken.worker.store_client import ControlStore

pytestmark = pytest.mark.timeout(30)
MOVES = [Move("object 'model'", 0, 3), Move("object 'optimizer'", 1, 3)]
MOVERS = movers_in(MOVES)


def _later(seconds: float, fn) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(seconds), fn()), daemon=True)
    thread.start()
    return thread


def test_the_movers_are_the_senders_and_receivers_of_the_plan():
    assert movers_in(MOVES) == [0, 1, 3]
    assert movers_in([]) == []


def test_the_wait_ends_when_every_mover_marked_its_generation_done():
    store = dist.HashStore()
    movers.mark_done(store, 1, 0)  # generation 1's marks do not count for generation 2
    movers.mark_done(store, 2, 0)
    marks = [_later(0.3, lambda: movers.mark_done(store, 2, 1)), _later(0.6, lambda: movers.mark_done(store, 2, 3))]
    started = time.monotonic()
    movers.wait_done(store, 2, MOVERS, aborted=lambda: False, timeout_s=10, poll_s=0.1)
    waited = time.monotonic() - started
    assert 0.5 < waited < 3, waited
    for t in marks:
        t.join()


def test_an_abort_order_for_a_later_generation_ends_the_wait():
    store, abort = dist.HashStore(), threading.Event()
    _later(0.3, abort.set)
    started = time.monotonic()
    with pytest.raises(CollectiveAborted, match="while waiting for the transfer of generation 1"):
        movers.wait_done(store, 1, MOVERS, aborted=abort.is_set, timeout_s=10, poll_s=0.1)
    assert time.monotonic() - started < 2


def test_the_wait_gives_up_at_its_timeout_and_the_caller_goes_on():
    started = time.monotonic()
    movers.wait_done(dist.HashStore(), 1, MOVERS, aborted=lambda: False, timeout_s=0.5, poll_s=0.1)
    assert 0.4 < time.monotonic() - started < 3


def test_a_failed_store_ends_the_wait_at_once_and_marking_done_only_logs(caplog):
    """The controller's store gone (a closed service): no spinning on the error, no exception."""
    svc = StoreService()
    svc.open_attempt(0)
    server = Server("127.0.0.1", 0, b"s" * 32, svc.serve)
    server.start()
    store = ControlStore("127.0.0.1", server.port, b"s" * 32, rank=0, attempt=0, pid=0, timeout_s=5.0)
    try:
        svc.close()
        server.close()
        started = time.monotonic()
        movers.wait_done(store, 1, MOVERS, aborted=lambda: False, timeout_s=10, poll_s=1.0)
        assert time.monotonic() - started < 0.5
        movers.mark_done(store, 1, 0)
        assert "could not mark its transfer of generation 1 done" in caplog.text
    finally:
        store.close()


def test_without_a_store_nothing_waits():
    movers.wait_done(None, 1, MOVERS, aborted=lambda: False, timeout_s=10)
    movers.mark_done(None, 1, 0)
