"""Waiting on collectives (comm/wait.py): with an AbortWatch the wait blocks, yet leaves at once on an abort.

Real gloo groups inside one process: each rank is a thread with its own ProcessGroupGloo over a
shared HashStore. How often the wait asks its abort check is what tells blocking from polling
(a polling wait asks it before every sleep of at most 2 ms; a blocked one once per wake-up).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from unbroken.comm.wait import BACKSTOP_S, BRIEF_SLICE, BRIEF_WAIT_S, AbortWatch, wait_all
from unbroken.errors import CollectiveAborted

pytestmark = pytest.mark.timeout(60)


class CountingCheck:
    """An abort check that counts how often it is asked; ``fire()`` makes it say abort."""

    def __init__(self) -> None:
        self.calls = 0
        self.fired = False

    def __call__(self) -> bool:
        self.calls += 1
        return self.fired


def _pair(timeout_s: float = 20.0) -> list[dist.ProcessGroup]:
    store, groups = dist.HashStore(), [None, None]

    def build(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=timeout_s))
    threads = [threading.Thread(target=build, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return groups


def _late_peer(group: dist.ProcessGroup, delay_s: float) -> threading.Thread:
    def run() -> None:
        time.sleep(delay_s)
        group.allreduce([torch.ones(4)]).wait()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_wait_with_an_abort_watch_blocks_until_the_peer_arrives():
    groups = _pair()
    delay_s = 1.0
    peer = _late_peer(groups[1], delay_s)
    check = CountingCheck()
    t = torch.ones(4)
    started = time.monotonic()
    wait_all([groups[0].allreduce([t])], AbortWatch(check), [], "test all-reduce")
    waited_s = time.monotonic() - started
    peer.join(10)
    assert torch.equal(t, torch.full((4,), 2.0))
    # Blocked: asked once per wake-up (the backstop's and the end's), not every few ms, after the
    # first BRIEF_WAIT_S in torch's timed waits (asked once per slice).
    brief = BRIEF_WAIT_S / BRIEF_SLICE.total_seconds() + 1
    assert check.calls <= waited_s / BACKSTOP_S + 3 + brief, (check.calls, waited_s)
    polled = CountingCheck()  # the same wait with a plain callable polls (the path without a watch)
    peer = _late_peer(groups[1], delay_s)
    started = time.monotonic()
    wait_all([groups[0].allreduce([torch.ones(4)])], polled, [], "test all-reduce")
    assert polled.calls > 2 * (time.monotonic() - started) / BACKSTOP_S + 3
    peer.join(10)


def test_a_blocked_wait_leaves_as_soon_as_the_watch_is_woken():
    groups = _pair()
    check = CountingCheck()
    watch = AbortWatch(check)
    graveyard: list = []
    work = groups[0].allreduce([torch.ones(4)])  # the peer never joins: only the abort ends this wait

    def abort_later() -> None:
        time.sleep(0.3)
        check.fired = True
        watch.wake()
    threading.Thread(target=abort_later, daemon=True).start()
    started = time.monotonic()
    with pytest.raises(CollectiveAborted, match="test all-reduce aborted on the abort order with 1 of 1"):
        wait_all([work], watch, graveyard, "test all-reduce")
    assert time.monotonic() - started < 0.3 + BACKSTOP_S  # woken, not found by the backstop
    assert graveyard == [work]  # kept referenced until it ends
    groups[1].allreduce([torch.ones(4)]).wait()  # the peer arrives: the abandoned op ends
    work.wait()


def test_a_failed_op_raises_its_error_with_a_note_not_an_abort():
    groups = _pair(timeout_s=1.0)
    work = groups[0].allreduce([torch.ones(4)])  # the peer never joins: gloo fails it at its timeout
    with pytest.raises(RuntimeError) as info:
        wait_all([work], AbortWatch(CountingCheck()), [], "test all-reduce")
    assert not isinstance(info.value, CollectiveAborted)
    assert "unbroken: during the test all-reduce" in getattr(info.value, "__notes__", [])


def test_a_collective_that_ends_within_the_brief_wait_never_wakes_a_python_thread():
    """The steady step's case: the peer is there, the all-reduce ends in milliseconds inside torch's own
    timed wait; the woken wait (a completion callback on the op's future waking an event) never begins
    (waking Python from gloo's thread cost 0.35 ms per all-reduce at 4 ranks on 2 cores)."""
    class Watch(AbortWatch):
        woken_waits = 0

        def _add(self, event):
            self.woken_waits += 1
            super()._add(event)

    groups = _pair()
    peer = _late_peer(groups[1], 0.0)
    watch = Watch(CountingCheck())
    work = groups[0].allreduce([torch.ones(4)])
    wait_all([work], watch, [], "test all-reduce")
    peer.join(10)
    assert work.is_completed() and watch.woken_waits == 0
    peer = _late_peer(groups[1], 0.5)  # a longer wait goes on in the woken wait
    wait_all([groups[0].allreduce([torch.ones(4)])], watch, [], "test all-reduce")
    peer.join(10)
    assert watch.woken_waits == 1
