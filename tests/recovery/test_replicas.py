"""The one replica interface: a job's shape picks its layout, and both layouts answer alike."""

from __future__ import annotations

import pytest

from unbroken.errors import NoLiveReplica
from unbroken.recovery.mesh_map import MeshReplicaMap
from unbroken.recovery.replica_map import ReplicaMap
from unbroken.recovery.replicas import Replicas, holders_of_all, job_replicas


def test_a_jobs_shape_picks_its_layout():
    assert job_replicas(4, 0) == ReplicaMap.full(4)
    assert job_replicas(4, 2) == ReplicaMap(4, 2)
    assert job_replicas(4, 0, (("pp", 2), ("dp", 2)), "dp") == MeshReplicaMap((("pp", 2), ("dp", 2)), "dp")
    assert job_replicas(8, 2, (("pp", 2), ("dp", 4)), "dp") == \
        MeshReplicaMap((("pp", 2), ("dp", 4)), "dp", shard_replicas=2)


@pytest.mark.parametrize("replicas", [ReplicaMap.full(4), ReplicaMap(4, 2), ReplicaMap(4, 1),
                                      MeshReplicaMap((("pp", 2), ("dp", 2)), "dp"),
                                      MeshReplicaMap((("pp", 1), ("dp", 4)), "dp", shard_replicas=2)],
                         ids=repr)
def test_both_layouts_answer_the_same_questions_the_same_way(replicas: Replicas):
    everyone = set(range(replicas.world_size))
    assert {p for r in everyone for p in replicas.pieces_of(r)} == set(replicas.pieces())
    for rank in everyone:
        for piece in replicas.pieces_of(rank):
            holders = replicas.holders(piece)
            assert rank in holders and holders == sorted(holders)
            assert replicas.live_source(piece, everyone) == holders[0]
            assert replicas.live_source(piece, everyone, exclude=holders) is None
        mates = holders_of_all(replicas, rank)
        assert rank in mates and all(set(mates) <= set(replicas.holders(p)) for p in replicas.pieces_of(rank))
        if len(mates) > 1:
            assert set(replicas.sources_for(rank, everyone)) == set(replicas.pieces_of(rank))
        else:
            with pytest.raises(NoLiveReplica):
                replicas.sources_for(rank, everyone)
