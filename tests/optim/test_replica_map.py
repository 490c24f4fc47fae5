"""ReplicaMap and FlatLayout: pure arithmetic, no processes."""

from __future__ import annotations

import pytest

from unbroken.errors import NoLiveReplica, OptimizerError, UnbrokenError
from unbroken.optim import Piece, ReplicaMap
from unbroken.optim.layout import FlatLayout

LAYOUTS = [(d, n) for d in (2, 4, 8) for n in sorted({1, 2, d})]
PARAMS = Piece("params", 0)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("d,n", LAYOUTS)
def test_holders_follow_the_block_layout(d, n):
    rmap = ReplicaMap(d, n)
    shards = d // n
    assert rmap.num_shards == shards
    assert rmap.holders(PARAMS) == list(range(d))
    for s in range(shards):
        assert rmap.holders(Piece("optimizer_shard", s)) == [s + k * shards for k in range(n)]
    # Every rank holds the params and exactly one shard: r % (d/N); blocks are contiguous.
    for r in range(d):
        assert rmap.pieces_of(r) == [PARAMS, Piece("optimizer_shard", r % shards)]
        assert rmap.block_of(r) == r // shards
        assert r in rmap.block_ranks(rmap.block_of(r))
        for piece in rmap.pieces_of(r):
            assert r in rmap.holders(piece)
    # Each block holds every shard once.
    for b in range(n):
        assert sorted(rmap.shard_of(r) for r in rmap.block_ranks(b)) == list(range(shards))
    assert rmap.pieces() == [PARAMS] + [Piece("optimizer_shard", s) for s in range(shards)]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("d,n", LAYOUTS)
def test_sources_for_a_lost_rank(d, n):
    rmap = ReplicaMap(d, n)
    shards = d // n
    for lost in range(d):
        alive = set(range(d)) - {lost}
        if n == 1:  # no replica: the lost shard has no other holder
            with pytest.raises(NoLiveReplica) as info:
                rmap.sources_for(lost, alive)
            err = info.value
            assert err.piece == Piece("optimizer_shard", lost % shards)
            assert err.dead == (lost,) and err.holders == (lost,)
            assert f"optimizer shard {lost % shards}" in str(err) and f"[{lost}]" in str(err)
            continue
        sources = rmap.sources_for(lost, alive)
        assert set(sources) == set(rmap.pieces_of(lost))
        for piece, source in sources.items():
            assert source != lost and source in alive and source in rmap.holders(piece)
        assert sources[PARAMS] == (1 if lost == 0 else 0)  # lowest live holder: deterministic


@pytest.mark.timeout(10)
@pytest.mark.parametrize("d,n", [(4, 2), (8, 2), (8, 4)])
def test_no_live_holder_names_piece_and_dead_holders(d, n):
    rmap = ReplicaMap(d, n)
    shard = Piece("optimizer_shard", 1)
    holders = rmap.holders(shard)
    alive = set(range(d)) - set(holders)
    assert rmap.live_source(shard, alive) is None
    with pytest.raises(NoLiveReplica) as info:
        rmap.sources_for(holders[0], alive)
    assert isinstance(info.value, UnbrokenError)
    assert info.value.piece == shard and info.value.dead == tuple(holders)
    assert str(holders) in str(info.value)
    # One live holder is enough, and `exclude` skips a holder that is alive but unusable.
    assert rmap.live_source(shard, alive | {holders[-1]}) == holders[-1]
    assert rmap.live_source(shard, alive | {holders[-1]}, exclude={holders[-1]}) is None


@pytest.mark.timeout(10)
def test_full_replication_is_one_shard_held_by_all():
    rmap = ReplicaMap.full(4)
    assert rmap == ReplicaMap(4, 4) and rmap.num_shards == 1
    assert rmap.holders(Piece("optimizer_shard", 0)) == [0, 1, 2, 3]
    assert rmap.sources_for(0, {1, 2, 3}) == {PARAMS: 1, Piece("optimizer_shard", 0): 1}
    with pytest.raises(NoLiveReplica):
        rmap.sources_for(2, {2})


@pytest.mark.timeout(10)
@pytest.mark.parametrize("d,n,message", [
    (4, 3, "num_replicas=3 does not divide the data-parallel world size 4; allowed: a divisor of 4 (1, 2, 4)"),
    (4, 8, "num_replicas=8 is larger than the data-parallel world size 4"),
    (4, 0, "num_replicas must be an int >= 1, got 0"),
    (0, 1, "world_size must be an int >= 1, got 0"),
])
def test_bad_layouts_are_refused(d, n, message):
    with pytest.raises(OptimizerError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ReplicaMap(d, n)


@pytest.mark.timeout(10)
def test_bad_pieces_and_ranks_are_refused():
    rmap = ReplicaMap(4, 2)
    with pytest.raises(OptimizerError, match="kind 'grads' is unknown"):
        Piece("grads", 0)  # type: ignore[arg-type]
    with pytest.raises(OptimizerError, match="has shards 0..1"):
        rmap.holders(Piece("optimizer_shard", 2))
    with pytest.raises(OptimizerError, match="rank 4 out of range"):
        rmap.pieces_of(4)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_flat_layout_pieces_tile_the_space_and_buckets_ignore_n(n):
    numels = [[100, 7, 300], [0], [65, 1]]
    layout = FlatLayout(numels, world_size=4, num_replicas=n, bucket_numel=100)
    reference = FlatLayout(numels, world_size=4, num_replicas=4, bucket_numel=100)
    assert layout.grad_buckets() == reference.grad_buckets()  # the all-reduce does not depend on N
    assert layout.param_offsets == reference.param_offsets == [[0, 100, 107], [448], [448, 513]]
    assert layout.regions == [(0, 448), (448, 448), (448, 576)]
    assert layout.numel == 473 and layout.used_numel == 576
    covered = []
    for s in range(layout.num_shards):
        pieces = layout.pieces(s)
        assert len(pieces) == 3
        for (a, b), (start, end) in zip(pieces, layout.regions):
            assert start <= a <= b <= end
            assert a % 64 == 0 or a == start  # cuts fall on 64-element boundaries
        covered += [(a, b) for a, b in pieces if b > a]
        assert sum(b - a for a, b in pieces) == layout.shard_range(s)[1] - layout.shard_range(s)[0]
        chunks = layout.gather_chunks(s)
        assert all(b - a <= 128 for a, b in chunks)  # bucket rounded up to the alignment
    assert sorted(covered) == sorted(set(covered))
    assert sum(b - a for a, b in covered) == layout.used_numel
