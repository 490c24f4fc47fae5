"""Point-to-point ops on a SurvivingGroup (a pipeline's activations and gradients), in one process.

Two ranks are two threads, each with its own SurvivingGroup over a HashStore (as in
test_group.py). gloo's send/recv works complete only inside ``wait()``; these tests show that a
send/recv on a SurvivingGroup completes through the polling wait, marks no phase, and leaves at
once on an abort order.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from tests.parallel.test_group import _pair
from unbroken.errors import CollectiveAborted
from unbroken.parallel.group import AbortSignal, DetachedCollective, SurvivingGroup


def test_send_and_recv_complete_through_the_polling_wait_and_mark_no_phase():
    store, graveyard = dist.HashStore(), []
    signals = [AbortSignal(), AbortSignal()]
    groups = _pair(store, 0, signals, graveyard)
    reductions = []
    for g in groups:
        g._before_reduce = lambda: reductions.append(1)
    sent, got = torch.arange(6.0), torch.zeros(6)
    send = groups[0].send([sent], 1, 3)
    recv = groups[1].recv([got], 0, 3)
    started = time.monotonic()
    while not (send.is_completed() and recv.is_completed()):  # the polling a pipeline's wait() does
        assert time.monotonic() - started < 10, "a point-to-point work never reported completion"
        time.sleep(0.001)
    assert recv.wait() and send.wait()
    assert torch.equal(got, sent)
    assert not reductions, "a send/recv marked phase 'sync' (it is no gradient reduction)"
    assert not graveyard


def test_blocking_waits_on_both_sides_deliver_the_tensor():
    store, graveyard = dist.HashStore(), []
    groups = _pair(store, 0, [AbortSignal(), AbortSignal()], graveyard)
    got = torch.zeros(3)
    ops = [lambda: groups[0].send([torch.ones(3)], 1, 0).wait(), lambda: groups[1].recv([got], 0, 0).wait()]
    threads = [threading.Thread(target=op) for op in ops]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert torch.equal(got, torch.ones(3))


def test_a_recv_whose_sender_never_sends_leaves_at_once_on_the_abort_order():
    store, graveyard = dist.HashStore(), []
    signals = [AbortSignal(), AbortSignal()]
    groups = _pair(store, 0, signals, graveyard)
    got = torch.zeros(4)
    work = groups[1].recv([got], 0, 7)  # rank 0 never sends: gloo would block until its timeout
    started = time.monotonic()
    threading.Timer(0.2, signals[1].fire, args=("test order",)).start()
    with pytest.raises(CollectiveAborted):
        work.wait()
    assert 0.15 < time.monotonic() - started < 2.0
    assert any(w is work._inner for w in graveyard), "the abandoned recv must stay referenced"
    groups[0].backend.send([torch.ones(4)], 1, 7).wait()  # match it: no blocked gloo thread left behind


def test_point_to_point_ops_are_refused_before_the_rank_joined_a_generation():
    group = SurvivingGroup(0, 2, [0, 1], "g0", AbortSignal(), [])
    with pytest.raises(DetachedCollective, match="send with group rank 1 .* has not joined the survivors"):
        group.send([torch.ones(2)], 1, 0)


class _BrokenPairBackend:
    """A gloo backend whose pair to the peer already broke: gloo raises at the issue of a send."""

    def send(self, tensors, dst, tag):
        raise RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                           "[127.0.0.1]:25287: Connection reset by peer.")

    def recv(self, tensors, src, tag):
        raise RuntimeError("Tensors must be contiguous")  # a script's error, not a lost peer


def test_a_send_to_a_peer_lost_a_moment_ago_fails_the_generation_like_a_failed_wait():
    """Seen in the slow set (PP2 x DP2, a kill at update): a survivor's send to the dead rank raised
    at the issue, before the abort order came, and the session took it for the script's bug."""
    signal = AbortSignal()
    group = SurvivingGroup(0, 2, [0, 1], "g0", signal, [])
    group._attach(0, _BrokenPairBackend())
    with pytest.raises(RuntimeError, match="Connection reset") as caught:
        group.send([torch.ones(2)], 1, 0)
    assert signal.failed and any(n.startswith("unbroken: during the send") for n in caught.value.__notes__)
    signal.fire("rank 1 was killed")  # the order is out: it is the cause
    with pytest.raises(CollectiveAborted, match="aborted on the abort order; it had failed"):
        group.send([torch.ones(2)], 1, 0)
    signal.clear()
    with pytest.raises(RuntimeError, match="contiguous") as caught:  # anything else stays the script's
        group.recv([torch.ones(2)], 1, 0)
    assert not signal.failed and not getattr(caught.value, "__notes__", [])
