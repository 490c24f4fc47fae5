"""Point-to-point state transfer (comm/p2p.py) and its plan (recovery/transfer_plan.py).

The plan is pure and tested as such. The transfer runs on real gloo groups inside one process:
each rank is a thread with its own ProcessGroupGloo over a shared HashStore (fast; the default
process group is never touched).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from unbroken.comm.p2p import exchange_states, send_recv_tensors
from unbroken.errors import NoLiveReplica
from unbroken.recovery.transfer_plan import Move, involved, plan_moves

pytestmark = pytest.mark.timeout(60)


# -- the plan --------------------------------------------------------------------------------
def test_pieces_spread_over_live_holders_one_source_each():
    alive = [0, 1, 3]
    pieces = ["model", "optimizer", "scheduler", "sampler"]
    moves = plan_moves(pieces, {p: alive for p in pieces}, {p: [2] for p in pieces}, alive)
    assert moves == [Move("model", 0, 2), Move("optimizer", 1, 2), Move("scheduler", 3, 2), Move("sampler", 0, 2)]
    assert plan_moves(pieces, {p: alive for p in pieces}, {p: [2] for p in pieces}, alive) == moves  # same everywhere


def test_two_receivers_never_send_to_themselves_and_idle_ranks_are_in_no_move():
    holders = {"shard 0": [0, 2], "shard 1": [1, 3]}
    moves = plan_moves(["shard 0", "shard 1"], holders, {"shard 0": [2], "shard 1": [3]}, alive=[0, 1, 4])
    assert moves == [Move("shard 0", 0, 2), Move("shard 1", 1, 3)]
    assert not involved(moves, 4)
    with pytest.raises(NoLiveReplica, match=r"no live holder of shard 1 for rank 3: its holders \[1, 3\]"):
        plan_moves(["shard 1"], holders, {"shard 1": [3]}, alive=[0, 2])


# -- the transfer on real gloo ---------------------------------------------------------------
def _groups(world_size: int) -> list[dist.ProcessGroup]:
    store, groups = dist.HashStore(), [None] * world_size

    def build(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("gen1/", store), rank, world_size,
                                             timedelta(seconds=20))
    _run_ranks(world_size, build)
    return groups


def _run_ranks(world_size: int, fn) -> None:
    errors: list[BaseException] = []

    def wrap(rank: int) -> None:
        try:
            fn(rank)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
    threads = [threading.Thread(target=wrap, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank did not finish"
    if errors:
        raise errors[0]


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))


def _optimizer_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(5, 3, generator=g),
                          "count": torch.arange(4, dtype=torch.int64)}},
            "param_groups": [{"lr": 0.003, "betas": [0.9, 0.95], "params": [0]}]}


def test_replacement_gets_each_piece_from_one_holder_into_its_own_tensors_and_idle_rank_takes_no_part():
    # Ranks 0, 1, 2 survive and hold everything; rank 3 is the replacement with its own fresh model.
    world = 4
    groups = _groups(world)
    trees = {r: {"object 'model'": _model(0).state_dict(), "object 'optimizer'": _optimizer_state(1)}
             for r in range(3)}
    own_model = _model(99)  # the replacement built its model from another seed: different values
    own_ptrs = {n: t.data_ptr() for n, t in own_model.state_dict().items()}
    moves = plan_moves(list(trees[0]), {k: [0, 1, 2] for k in trees[0]}, {k: [3] for k in trees[0]}, [0, 1, 2])
    assert [m.src for m in moves] == [0, 1] and not involved(moves, 2)
    got: dict[int, dict] = {}
    asked: list[int] = []

    def rank_main(rank: int) -> None:
        if rank == 2:  # in no move: it returns at once, issuing nothing, asking for no state
            got[rank] = exchange_states(moves, groups[rank], state_of=lambda k: asked.append(rank),
                                        local_of=lambda k: asked.append(rank), device=torch.device("cpu"),
                                        should_abort=lambda: False, graveyard=[], what="test")
            return
        local = {"object 'model'": own_model.state_dict()} if rank == 3 else {}
        got[rank] = exchange_states(moves, groups[rank], state_of=lambda k: trees[rank][k],
                                    local_of=lambda k: local.get(k), device=torch.device("cpu"),
                                    should_abort=lambda: False, graveyard=[], what="test")
    _run_ranks(world, rank_main)
    assert got[0] == {} and got[1] == {} and got[2] == {} and asked == []
    received = got[3]
    sent_model, sent_opt = trees[0]["object 'model'"], trees[1]["object 'optimizer'"]
    assert received["object 'model'"].keys() == sent_model.keys()
    for name, t in sent_model.items():  # bit-exact, and landed in the replacement's own tensors
        assert torch.equal(received["object 'model'"][name], t)
        assert received["object 'model'"][name].data_ptr() == own_ptrs[name]
    assert torch.equal(own_model.state_dict()["0.weight"], sent_model["0.weight"])
    state = received["object 'optimizer'"]["state"][0]
    for key in ("step", "exp_avg", "count"):
        assert torch.equal(state[key], sent_opt["state"][0][key]) and state[key].dtype == sent_opt["state"][0][key].dtype
    assert received["object 'optimizer'"]["param_groups"] == sent_opt["param_groups"]


def test_bare_tensor_ranges_go_only_between_their_two_ranks():
    world = 3
    groups = _groups(world)
    flats = {r: torch.full((10,), float(r)) for r in range(world)}
    flats[0][:5] = torch.arange(5.0)
    ops_of = lambda r: [(0, 2, flats[r][0:5]), (1, 2, flats[r][5:10])]  # noqa: E731 - same list on every rank
    _run_ranks(world, lambda r: send_recv_tensors(ops_of(r), groups[r], should_abort=lambda: False,
                                                  graveyard=[], what="test"))
    assert torch.equal(flats[2], torch.tensor([0.0, 1, 2, 3, 4, 1, 1, 1, 1, 1]))
    assert torch.equal(flats[1], torch.ones(10))  # a sender's own buffer is unchanged


class _CountingGroup:
    """A gloo group that counts the send ops a rank issues (the transfer's message count)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group, self.sends = group, 0

    def rank(self) -> int:
        return self._group.rank()

    def send(self, tensors, dst, tag):
        self.sends += 1
        return self._group.send(tensors, dst, tag)

    def recv(self, tensors, src, tag):
        return self._group.recv(tensors, src, tag)


def test_pieces_of_one_holder_travel_as_one_bundle_large_tensors_straight_into_their_place():
    # Rank 0 holds three pieces for rank 1: a model and an optimizer state (small tensors: one flat
    # buffer) and a 2 MiB tensor (over BATCH_MAX_BYTES: its own message, into the receiver's tensor).
    from unbroken.comm.p2p import BATCH_MAX_BYTES

    groups = _groups(2)
    big = torch.arange(2 * 1024 * 1024 // 4, dtype=torch.float32)
    assert big.numel() * 4 > BATCH_MAX_BYTES
    trees = {"object 'model'": _model(0).state_dict(), "object 'optimizer'": _optimizer_state(1),
             "object 'table'": {"big": big, "flag": torch.tensor(True), "empty": torch.zeros(0)}}
    own_model, own_big = _model(5), torch.zeros_like(big)
    local = {"object 'model'": own_model.state_dict(), "object 'table'": {"big": own_big}}
    moves = [Move(key, 0, 1) for key in trees]
    counting = _CountingGroup(groups[0])
    got: dict[int, dict] = {}
    timings: dict[str, float] = {}

    def rank_main(rank: int) -> None:
        group = counting if rank == 0 else groups[1]
        got[rank] = exchange_states(moves, group, state_of=lambda k: trees[k], local_of=lambda k: local.get(k),
                                    device=torch.device("cpu"), should_abort=lambda: False, graveyard=[],
                                    what="test", timings=timings if rank == 1 else None)
    _run_ranks(2, rank_main)
    assert counting.sends == 4  # header, meta, flat buffer, the one large tensor: not one message per tensor
    received = got[1]
    table = received["object 'table'"]
    assert torch.equal(table["big"], big) and table["big"].data_ptr() == own_big.data_ptr()
    assert table["flag"].dtype == torch.bool and bool(table["flag"]) and table["empty"].numel() == 0
    for name, t in trees["object 'model'"].items():
        assert torch.equal(received["object 'model'"][name], t)
        assert received["object 'model'"][name].data_ptr() == own_model.state_dict()[name].data_ptr()
    state = received["object 'optimizer'"]["state"][0]
    assert torch.equal(state["exp_avg"], trees["object 'optimizer'"]["state"][0]["exp_avg"])
    assert state["count"].dtype == torch.int64 and received["object 'optimizer'"]["param_groups"][0]["lr"] == 0.003
    assert {"headers_s", "bodies_s", "large_s", "unpack_s"} <= set(timings)


def test_a_meta_naming_other_pieces_is_refused():
    from unbroken.comm.p2p import _Bundle, _Incoming
    from unbroken.errors import CheckpointCorrupt

    incoming = _Incoming(_Bundle(0, 0, 1, ["object 'model'"]), {"object 'model'": None})
    incoming.meta = torch.frombuffer(bytearray(b'{"pieces": [{"key": "object \'x\'", "spec": {}, "index": []}]}'),
                                     dtype=torch.uint8)
    with pytest.raises(CheckpointCorrupt, match=r"carries pieces \[\"object 'x'\"\], expected \[\"object 'model'\"\]"):
        incoming.plan(torch.device("cpu"))
    incoming.meta = torch.frombuffer(bytearray(b'{"pieces": [{"key": 1}]}'), dtype=torch.uint8)
    with pytest.raises(CheckpointCorrupt, match="does not list each piece's key"):
        incoming.plan(torch.device("cpu"))


def test_a_send_to_a_lazily_connected_peer_that_never_came_still_aborts():
    """--lazy-connect: a send connects its pair (a store get of the peer's address, then TCP). A
    peer lost before it published its address holds that call until the group's timeout, so the
    sends are posted in the exchange's thread and the abort order still ends the exchange at once."""
    from unbroken.comm.groups import gloo_group
    from unbroken.comm.wait import AbortWatch
    from unbroken.errors import CollectiveAborted

    group = gloo_group(dist.HashStore(), 0, 2, timedelta(seconds=30), lazy_connect=True)  # rank 1 never comes
    fired = threading.Event()
    watch = AbortWatch(fired.is_set)

    def abort_later() -> None:
        fired.wait(0.5)
        fired.set()
        watch.wake()
    threading.Thread(target=abort_later, daemon=True).start()
    graveyard: list = []
    started = time.monotonic()
    with pytest.raises(CollectiveAborted):
        exchange_states([("model", 0, 1)], group, state_of=lambda key: {"w": torch.ones(3)}, local_of=lambda key: None,
                        device=torch.device("cpu"), should_abort=watch, graveyard=graveyard, what="test transfer")
    assert time.monotonic() - started < 10  # not the group's 30 s timeout
    assert len(graveyard) == 1  # the exchange's thread, still in its connect, stays referenced
