"""The controller's decisions for a job on a mesh (job.mesh): replicas live along its dp dimension."""

from __future__ import annotations

from unbroken.controller import machine as sm

from tests.conftest import run_machine as run

PP_DP = (["pp", "dp", "tp"], [2, 2, 1])  # ranks 0, 1: stage pp=0; ranks 2, 3: stage pp=1


def start(mesh=PP_DP, world=4, num_replicas=0):
    state = sm.JobState(sm.JobPolicy(max_restarts=3, allowed=("recover-in-place", "recover", "exit")), world_size=world)
    state, _ = sm.transition(state, sm.AgentJoined(0))
    for rank in range(world):
        state, _ = sm.transition(state, sm.SessionReady(rank, 0, num_replicas, mesh_names=mesh[0], mesh_sizes=mesh[1],
                                                        mesh_replicate="dp"))
    return state


def test_one_rank_of_each_stage_lost_is_recovered_in_flight():
    """Ranks 0 and 2 hold different stages; each stage keeps a live replica (1 and 3). The flat
    layout of two replicas would have called this a lost shard (ranks 0 and 2 hold shard 0)."""
    state = start()
    assert state.mesh == (("pp", 2), ("dp", 2), ("tp", 1))
    state, _ = run(state, sm.RankExited(0, 0, None, 9))
    state, actions = run(state, sm.RankExited(2, 0, None, 9))
    assert actions[0].rung == "recover-in-place" and state.recovery.replaced == {0, 2}


def test_both_replicas_of_a_stage_lost_fall_to_the_checkpoint_tiers():
    """Ranks 0 and 1 are stage pp=0's only holders; under full replication this would be in flight."""
    state = start()
    state, _ = run(state, sm.RankExited(0, 0, None, 9))
    state, actions = run(state, sm.RankExited(1, 0, None, 9))
    assert [type(a).__name__ for a in actions] == ["Decide", "StopAttempt"] and actions[0].rung == "exit"
    assert "no live replica of the state of pp=0, tp=0 of rank 0 (holders [0, 1] all lost)" in actions[0].reason
    state, actions = run(state, sm.AgentStopped(0, 0))
    assert actions == [sm.StartAttempt(1)] and state.mesh == ()  # the next attempt reports its mesh again


def test_a_mesh_without_replicas_restarts_the_job_for_any_loss():
    state = start(mesh=(["pp", "dp", "tp"], [2, 1, 2]))
    state, actions = run(state, sm.RankExited(3, 0, None, 9))
    assert actions[0].rung == "exit" and "no live replica of the state of pp=1, tp=1 of rank 3" in actions[0].reason


def test_a_sharded_optimizer_without_a_replica_inside_dp_restarts_the_job_for_any_loss():
    """num_replicas on a mesh: copies of a ShardedOptimizer's shards inside dp. With 1 (no replica),
    a lost rank's stage has a live dp replica but its optimizer shard has none."""
    state = start(num_replicas=1)
    state, actions = run(state, sm.RankExited(3, 0, None, 9))
    assert actions[0].rung == "exit"
    assert "no live replica of optimizer shard 1 of pp=1, tp=0 of rank 3 (holders [3] all lost)" in actions[0].reason


def test_a_sharded_optimizer_with_every_dp_rank_its_own_block_is_recovered_in_flight():
    state = start(num_replicas=2)
    state, actions = run(state, sm.RankExited(3, 0, None, 9))
    assert actions[0].rung == "recover-in-place" and state.recovery.replaced == {3}
