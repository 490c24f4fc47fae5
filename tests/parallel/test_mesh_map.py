"""MeshReplicaMap and object_moves: who holds each rank's state on a mesh. Pure, no processes."""

from __future__ import annotations

import itertools

import pytest
import torch

from unbroken.errors import ConfigError, NoLiveReplica
from unbroken.recovery.mesh_map import MeshPiece, MeshReplicaMap, object_moves

PP_DP_TP = (("pp", 2), ("dp", 2), ("tp", 1))


def test_ranks_are_laid_out_as_torch_lays_out_a_device_mesh():
    """Row-major, last dimension fastest: the same tensor init_device_mesh builds (arange().view)."""
    for dims in (PP_DP_TP, (("pp", 2), ("dp", 2), ("tp", 2)), (("dp", 2), ("tp", 2)), (("dp", 3), ("pp", 2))):
        rmap = MeshReplicaMap(dims)
        mesh = torch.arange(rmap.world_size).view(*rmap.sizes)
        for index in itertools.product(*(range(s) for s in rmap.sizes)):
            rank = int(mesh[index])
            assert rmap.coords_of(rank) == dict(zip(rmap.names, index))
            assert rmap.rank_of(dict(zip(rmap.names, index))) == rank
        for dim_i, name in enumerate(rmap.names):
            for rank in range(rmap.world_size):  # torch's group along `name`: the row of the mesh through rank
                index = list(int(i) for i in (mesh == rank).nonzero()[0])
                row = [int(mesh[tuple(index[:dim_i] + [k] + index[dim_i + 1:])]) for k in range(rmap.sizes[dim_i])]
                assert rmap.group_ranks(name, rank) == row


def test_a_ranks_state_is_held_by_the_ranks_with_its_other_coordinates_in_the_other_dp_slices():
    rmap = MeshReplicaMap(PP_DP_TP)
    assert rmap.world_size == 4 and rmap.num_replicas == 2
    stage0, stage1 = MeshPiece((("pp", 0), ("tp", 0))), MeshPiece((("pp", 1), ("tp", 0)))
    assert [rmap.piece_of(r) for r in range(4)] == [stage0, stage0, stage1, stage1]
    assert rmap.holders(stage0) == [0, 1] and rmap.holders(stage1) == [2, 3]
    assert rmap.pieces() == [stage0, stage1]
    assert str(stage1) == "the state of pp=1, tp=0"
    eight = MeshReplicaMap((("pp", 2), ("dp", 2), ("tp", 2)))
    assert eight.replicas_of(5) == [5, 7] and eight.piece_of(5) == MeshPiece((("pp", 1), ("tp", 1)))
    dp_tp = MeshReplicaMap((("dp", 2), ("tp", 2)))
    assert dp_tp.replicas_of(1) == [1, 3] and dp_tp.replicas_of(2) == [0, 2]


def test_recovery_asks_it_for_a_live_holder_of_every_piece():
    rmap = MeshReplicaMap(PP_DP_TP)
    assert rmap.sources_for(2, alive={0, 1, 3}) == {MeshPiece((("pp", 1), ("tp", 0))): 3}
    assert rmap.sources_for(0, alive={1, 2, 3}) == {MeshPiece((("pp", 0), ("tp", 0))): 1}
    assert rmap.live_source(rmap.piece_of(2), alive={0, 1}) is None
    with pytest.raises(NoLiveReplica, match=r"the state of pp=1, tp=0 for rank 2: its holders \[2, 3\]") as err:
        rmap.sources_for(2, alive={0, 1})  # both replicas of stage 1 lost: only a checkpoint helps
    assert err.value.holders == (2, 3) and err.value.dead == (2, 3)


def test_no_replicate_dimension_to_speak_of_means_no_live_holder():
    rmap = MeshReplicaMap((("pp", 2), ("dp", 1), ("tp", 2)))
    assert rmap.num_replicas == 1
    for rank in range(4):
        assert rmap.replicas_of(rank) == [rank]
        with pytest.raises(NoLiveReplica):
            rmap.sources_for(rank, alive=set(range(4)) - {rank})


def test_object_moves_send_each_replaced_rank_its_own_pieces_copy():
    rmap = MeshReplicaMap(PP_DP_TP)
    moves, names = object_moves(["model", "optimizer"], rmap, replaced=[2], alive=[0, 1, 3])
    assert [(m.src, m.dst) for m in moves] == [(3, 2), (3, 2)]  # stage 1 only from stage 1's replica
    assert sorted(names.values()) == ["model", "optimizer"] and {m.key for m in moves} == set(names)
    moves, names = object_moves(["model"], rmap, replaced=[0, 3], alive=[1, 2])
    assert sorted((names[m.key], m.src, m.dst) for m in moves) == [("model", 1, 0), ("model", 2, 3)]
    with pytest.raises(NoLiveReplica):
        object_moves(["model"], rmap, replaced=[2, 3], alive=[0, 1])


def test_object_moves_without_a_mesh_come_from_any_survivor_as_before():
    moves, names = object_moves(["model", "optimizer"], None, replaced=[2], alive=[0, 1, 3])
    assert names == {"object 'model'": "model", "object 'optimizer'": "optimizer"}
    assert [(m.key, m.src, m.dst) for m in moves] == [("object 'model'", 0, 2), ("object 'optimizer'", 1, 2)]


@pytest.mark.parametrize("dims,replicate,match", [
    ((), "dp", "at least one dimension"),
    ((("pp", 2), ("pp", 2)), "pp", "names must differ"),
    ((("pp", 0), ("dp", 2)), "dp", "size >= 1"),
    ((("pp", 2), ("dp", "2")), "dp", "size >= 1"),
    ((("pp", 2), ("tp", 2)), "dp", "replicate dimension 'dp' is not a mesh dimension"),
])
def test_a_bad_mesh_is_refused_with_what_is_wrong(dims, replicate, match):
    with pytest.raises(ConfigError, match=match):
        MeshReplicaMap(dims, replicate)


def test_out_of_range_ranks_and_coordinates_are_refused():
    rmap = MeshReplicaMap(PP_DP_TP)
    with pytest.raises(ConfigError, match="rank 4 out of range"):
        rmap.coords_of(4)
    with pytest.raises(ConfigError, match="pp=2 out of range"):
        rmap.rank_of({"pp": 2, "dp": 0, "tp": 0})
    with pytest.raises(ConfigError, match="'ep' is not a mesh dimension"):
        rmap.group_ranks("ep", 0)


# -- a distributed optimizer inside dp (ShardedOptimizer on the dp group) ---------------------
def test_a_sharded_optimizer_inside_dp_adds_each_ranks_shard_held_by_its_blocks_peers():
    """PP2 x DP4, N = 2: dp ranks 0,1 | 2,3 are the blocks; shard s is held at dp indices s, s + 2."""
    rmap = MeshReplicaMap((("pp", 2), ("dp", 4)), shard_replicas=2)
    assert rmap.num_shards == 2
    stage1 = MeshPiece((("pp", 1),))
    assert rmap.pieces_of(5) == [stage1, MeshPiece((("pp", 1),), 1)]
    assert rmap.holders(stage1) == [4, 5, 6, 7]
    assert rmap.holders(MeshPiece((("pp", 1),), 1)) == [5, 7]
    assert rmap.holders(MeshPiece((("pp", 0),), 0)) == [0, 2]
    assert str(MeshPiece((("pp", 1),), 1)) == "optimizer shard 1 of pp=1"
    assert rmap.sources_for(5, alive=[0, 1, 2, 3, 4, 6, 7]) == {stage1: 4, MeshPiece((("pp", 1),), 1): 7}
    assert len(rmap.pieces()) == 2 + 4 and rmap != MeshReplicaMap((("pp", 2), ("dp", 4)))


def test_full_replication_of_the_shards_needs_only_a_dp_replica_and_none_needs_the_lost_ranks_own():
    full = MeshReplicaMap(PP_DP_TP, shard_replicas=2)  # dp = N = 2: each rank its own block
    assert full.holders(full.pieces_of(3)[1]) == [2, 3]
    assert set(full.sources_for(3, alive=[0, 1, 2]).values()) == {2}
    alone = MeshReplicaMap(PP_DP_TP, shard_replicas=1)  # the seeds' --distributed-optimizer-no-replica
    assert alone.holders(alone.pieces_of(3)[1]) == [3]
    with pytest.raises(NoLiveReplica, match=r"optimizer shard 1 of pp=1, tp=0 for rank 3.*num_replicas"):
        alone.sources_for(3, alive=[0, 1, 2])


@pytest.mark.parametrize("shard_replicas", [3, -1, 1.0])
def test_shard_replicas_must_divide_the_dp_size(shard_replicas):
    with pytest.raises(ConfigError, match="shard_replicas=.* must be 0 .* or a divisor of the 'dp' dimension's size 2"):
        MeshReplicaMap(PP_DP_TP, shard_replicas=shard_replicas)
