"""SurvivingGroup and its works, on real gloo groups inside one process (fast).

Two ranks are two threads of this process, each with its own SurvivingGroup over a
HashStore; the default process group is never touched.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from unbroken.errors import CollectiveAborted
from unbroken.parallel.fabric import reconfigure_available
from unbroken.parallel.group import AbortSignal, DetachedCollective, SurvivingGroup


def _pair(store: dist.Store, gen: int, signals: list[AbortSignal], graveyard: list) -> list[SurvivingGroup]:
    """Two SurvivingGroups (ranks 0 and 1) attached to generation ``gen``'s gloo groups."""
    groups = [SurvivingGroup(r, 2, [0, 1], "g0", signals[r], graveyard) for r in range(2)]
    backends: list = [None, None]

    def build(rank: int) -> None:
        backends[rank] = dist.ProcessGroupGloo(dist.PrefixStore(f"gen{gen}/g0/", store), rank, 2,
                                               timedelta(seconds=20))
    threads = [threading.Thread(target=build, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for rank in range(2):
        groups[rank]._attach(gen, backends[rank])
    return groups


def _opts() -> dist.distributed_c10d.AllreduceOptions:
    opts = dist.distributed_c10d.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    return opts


def test_detached_group_completes_broadcast_and_allgather_locally_and_refuses_reductions():
    group = SurvivingGroup(1, 4, [0, 1, 2, 3], "g0", AbortSignal(), [])
    t = torch.arange(3.0)
    work = group.broadcast([t], dist.distributed_c10d.BroadcastOptions())
    assert work.is_completed() and work.wait()
    assert torch.equal(t, torch.arange(3.0))
    out = torch.zeros(12)
    group._allgather_base(out, t, dist.distributed_c10d.AllgatherOptions()).wait()
    assert torch.equal(out, torch.arange(3.0).repeat(4))
    with pytest.raises(DetachedCollective, match="allreduce on group 'g0' before this rank joined"):
        group.allreduce([t], _opts())


def test_collectives_follow_the_group_to_the_next_generation_and_the_object_stays():
    store, graveyard = dist.HashStore(), []
    signals = [AbortSignal(), AbortSignal()]
    groups = _pair(store, 0, signals, graveyard)
    first_ids = [id(g) for g in groups]
    for gen in (0, 1):
        if gen:
            again = _pair(store, 1, signals, graveyard)
            for old, new in zip(groups, again):
                old._attach(1, new.backend)  # the same objects move to generation 1
        tensors = [torch.full((4,), float(r + 1 + 10 * gen)) for r in range(2)]
        works = [groups[r].allreduce([tensors[r]], _opts()) for r in range(2)]
        for w in works:
            w.wait()
        assert all(torch.equal(t, torch.full((4,), 3.0 + 20 * gen)) for t in tensors)
        assert all(g.generation == gen for g in groups)
    assert [id(g) for g in groups] == first_ids
    assert len(graveyard) == 2  # generation 0's backends, kept referenced, never destroyed early


def test_abort_signal_ends_a_blocked_collective_at_once_and_keeps_its_work_in_the_graveyard():
    store, graveyard = dist.HashStore(), []
    signals = [AbortSignal(), AbortSignal()]
    groups = _pair(store, 0, signals, graveyard)
    t = torch.ones(8)
    work = groups[0].allreduce([t], _opts())  # rank 1 never joins it: it blocks (until the gloo timeout)
    failed_future = work.get_future()
    started = time.monotonic()
    threading.Timer(0.2, signals[0].fire, args=("test order",)).start()
    with pytest.raises(CollectiveAborted):
        work.wait()
    left_s = time.monotonic() - started
    assert 0.15 < left_s < 2.0, left_s
    assert work.is_completed() and not work.is_success()
    with pytest.raises(RuntimeError, match="CollectiveAborted"):
        failed_future.wait()  # the future torch's C++ callers (DDP's reducer) wait on fails too
    assert any(w is work._inner for w in graveyard)
    with pytest.raises(CollectiveAborted, match="issued after the abort order"):
        groups[0].allreduce([t], _opts()).wait()
    # Let rank 1 match the pending op so the test leaves no blocked gloo thread behind.
    groups[1].backend.allreduce([torch.ones(8)], _opts()).wait()


def test_reconfigure_feature_check_matches_the_installed_torch():
    major_minor = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    assert reconfigure_available() == (major_minor >= (2, 14) and hasattr(dist, "_reconfigure"))
    if major_minor <= (2, 13):
        assert not reconfigure_available()


def test_a_held_group_completes_collectives_locally_until_released():
    """A replacement holds its attached groups while the script builds its DDP: nothing reaches
    the survivors (rank 1 here never issues a matching op), reductions are refused."""
    store, graveyard = dist.HashStore(), []
    groups = _pair(store, 0, [AbortSignal(), AbortSignal()], graveyard)
    groups[0].held = True
    t = torch.arange(3.0)
    assert groups[0].broadcast([t], dist.distributed_c10d.BroadcastOptions()).wait()
    assert torch.equal(t, torch.arange(3.0))
    with pytest.raises(DetachedCollective, match="while it is held"):
        groups[0].allreduce([t], _opts())
    groups[0].held = False
    tensors = [torch.ones(2), torch.ones(2)]
    for w in [groups[r].allreduce([tensors[r]], _opts()) for r in range(2)]:
        w.wait()
    assert torch.equal(tensors[0], torch.full((2,), 2.0))


def test_a_failed_collective_marks_the_signal_until_the_next_generation():
    """Through DDP's reducer the error is a plain RuntimeError: ``failed`` is how the session knows
    a collective of the generation was lost to a fault."""
    store, graveyard = dist.HashStore(), []
    signals = [AbortSignal(), AbortSignal()]
    groups = _pair(store, 0, signals, graveyard)
    calls = []
    groups[0]._before_reduce = lambda: calls.append("reduce")
    work = groups[0].allreduce([torch.ones(4)], _opts())
    assert calls == ["reduce"] and not signals[0].failed
    signals[0].fire("test order")
    with pytest.raises(CollectiveAborted):
        work.wait()
    assert signals[0].failed and not signals[1].failed
    signals[0].clear()
    assert not signals[0].failed
    groups[1].backend.allreduce([torch.ones(4)], _opts()).wait()


@pytest.mark.timeout(60)
def test_reduce_scatter_completes_through_an_abortable_wait():
    """gloo's reduce-scatter works (torch 2.13) never report is_completed(), so a polling wait on
    them never ended (FSDP2's backward hung there); the group does it as an all-reduce."""
    store, graveyard = dist.HashStore(), []
    groups = _pair(store, 0, [AbortSignal(), AbortSignal()], graveyard)
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    outs = [torch.zeros(3), torch.zeros(3)]
    works = [groups[r]._reduce_scatter_base(outs[r], torch.arange(6.0) * (r + 1), opts) for r in range(2)]
    listed = [torch.zeros(2), torch.zeros(2)]
    deadline = time.monotonic() + 30
    while not all(w.is_completed() for w in works) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert all(w.is_completed() and w.is_success() for w in works)
    assert outs[0].tolist() == [0.0, 3.0, 6.0] and outs[1].tolist() == [9.0, 12.0, 15.0]
    works = [groups[r].reduce_scatter([listed[r]], [[torch.ones(2) * (r + 1), torch.ones(2)]], opts)
             for r in range(2)]
    for w in works:
        w.wait()
    assert listed[0].tolist() == [3.0, 3.0] and listed[1].tolist() == [2.0, 2.0]


@pytest.mark.timeout(60)
def test_coalesced_all_gather_and_reduce_scatter_which_gloo_lacks():
    """gloo has no allgather_into_tensor_coalesced / reduce_scatter_tensor_coalesced (a DTensor's
    redistribute, e.g. a full state dict of FSDP2, calls the first): the group composes them."""
    store, graveyard = dist.HashStore(), []
    groups = _pair(store, 0, [AbortSignal(), AbortSignal()], graveyard)
    gathered = [[torch.zeros(4), torch.zeros(2, 3)] for _ in range(2)]
    inputs = [[torch.tensor([1.0, 2.0]) + 10 * r, torch.arange(3.0) + 100 * r] for r in range(2)]
    works = [groups[r].allgather_into_tensor_coalesced(gathered[r], inputs[r], dist.distributed_c10d.AllgatherOptions())
             for r in range(2)]
    for w in works:
        w.wait()
    for r in range(2):
        assert gathered[r][0].tolist() == [1.0, 2.0, 11.0, 12.0]
        assert gathered[r][1].tolist() == [[0.0, 1.0, 2.0], [100.0, 101.0, 102.0]]
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    outs = [[torch.zeros(1), torch.zeros(2)] for _ in range(2)]
    ins = [[torch.tensor([1.0, 2.0]) * (r + 1), torch.arange(4.0) * (r + 1)] for r in range(2)]
    works = [groups[r].reduce_scatter_tensor_coalesced(outs[r], ins[r], opts) for r in range(2)]
    for w in works:
        w.wait()
    assert [o.tolist() for o in outs[0]] == [[3.0], [0.0, 3.0]]
    assert [o.tolist() for o in outs[1]] == [[6.0], [6.0, 9.0]]
