"""Rung `elastic` in the state machine (controller/elastic.py): a lost node with no standby shrinks the job
to the nodes left, renumbering ranks and handing out the lost ranks' data shards. Pure: no processes.
Growing back when the node returns: tests/controller/test_machine_scale_out.py."""

from __future__ import annotations

from unbroken.controller import elastic, machine as sm

from tests.conftest import run_machine as run


def start(world=6, nnodes=3, not_exact="", **policy):
    policy.setdefault("allowed", ("recover", "elastic", "exit"))
    state = sm.JobState(sm.JobPolicy(max_restarts=3, **policy), world_size=world, nnodes=nnodes)
    for node in range(nnodes):
        state, actions = sm.transition(state, sm.AgentJoined(node))
    assert actions == [sm.StartAttempt(0)]
    for rank in range(world):
        state, _ = sm.transition(state, sm.SessionReady(rank, 0, 0, not_exact=not_exact))
    return state


def test_a_lost_middle_node_shrinks_the_job_exactly_and_renumbers_the_ranks():
    state, actions = run(start(), sm.AgentLost(1))  # ranks 2, 3 of 6 (2 per node) go with node 1
    assert [type(a).__name__ for a in actions] == ["Decide", "StopAttempt"]
    assert actions[0].rung == "elastic" and "same global batch" in actions[0].reason
    assert state.phase is sm.JobPhase.STOPPING and state.world_size == 4
    assert state.placement == (0, 0, 2, 2)  # ranks 0-3 are the old 0, 1, 4, 5
    assert state.restore_ranks == (0, 1, 4, 5)  # each reloads what its process wrote under its old number
    assert state.data_world_size == 6 and state.data_ranks == ((0, 2), (1, 3), (4,), (5,))
    state, actions = run(state, sm.AgentStopped(0, 0), sm.AgentStopped(2, 0))
    assert actions == [sm.StartAttempt(1)] and state.phase is sm.JobPhase.RUNNING
    assert elastic.ranks_on(state, 2) == [2, 3]


def test_a_second_loss_splits_the_orphans_evenly_and_keeps_the_launch_data_world():
    state, _ = run(start(), sm.AgentLost(2), sm.AgentStopped(0, 0), sm.AgentStopped(1, 0))
    assert state.data_ranks == ((0, 4), (1, 5), (2,), (3,))
    for rank in range(4):
        state, _ = sm.transition(state, sm.SessionReady(rank, 1, 0))
    state, actions = run(state, sm.AgentLost(0))
    assert actions[0].rung == "elastic" and state.world_size == 2
    assert state.data_world_size == 6 and state.data_ranks == ((0, 2, 4), (1, 3, 5))
    assert state.restore_ranks == (2, 3) and state.placement == (1, 1)


def test_fast_mode_is_a_plain_smaller_job_with_the_lr_rule():
    state, _ = run(start(elastic_mode="fast", elastic_lr_scaling="linear"), sm.AgentLost(1))
    assert state.data_world_size == 4 and state.data_ranks == ((0,), (1,), (2,), (3,))
    assert state.lr_scale == 4 / 6
    state, _ = run(start(elastic_mode="fast", elastic_lr_scaling="sqrt"), sm.AgentLost(1))
    assert abs(state.lr_scale - (4 / 6) ** 0.5) < 1e-12


def test_a_script_that_cannot_keep_the_batch_fails_the_job_with_the_reason():
    state, actions = run(start(not_exact="the script never called job.data_ranks() in its steps"), sm.AgentLost(2))
    assert actions[-1].exit_code == 1 and state.phase is sm.JobPhase.FAILED
    assert "rung elastic cannot go on without them: rank 0 cannot keep the global batch on fewer ranks: the " \
           "script never called job.data_ranks()" in actions[-1].reason


def test_a_job_restart_after_the_shrink_reloads_each_rank_own_snapshots():
    state, _ = run(start(), sm.AgentLost(1), sm.AgentStopped(0, 0), sm.AgentStopped(2, 0))
    state, actions = run(state, sm.RankExited(3, 1, 1, None))  # a crash; rung exit (no recover-in-place)
    assert actions[0].rung == "exit" and state.restore_ranks == ()
    assert state.data_ranks == ((0, 2), (1, 3), (4,), (5,))  # the shape stays shrunk
