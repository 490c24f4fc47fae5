"""Scale-out in the state machine (controller/elastic.py): a job that rung elastic shrank grows back to
its launch shape at a committed step once every node of the launch is there again; the ranks taken in
fetch a surviving rank's snapshot; a scale-out whose ranks got no state is undone, never a fresh start.
Pure: no processes."""

from __future__ import annotations

from unbroken.controller import elastic, machine as sm
from unbroken.recovery.restore_point import RankOffer

from tests.conftest import run_machine as run


def start(world=6, nnodes=3, snapshot_every=1, **policy):
    policy.setdefault("allowed", ("recover", "elastic", "exit"))
    state = sm.JobState(sm.JobPolicy(max_restarts=5, **policy), world_size=world, nnodes=nnodes,
                        snapshot_every=snapshot_every)
    for node in range(nnodes):
        state, _ = sm.transition(state, sm.AgentJoined(node))
    for rank in range(world):
        state, _ = sm.transition(state, sm.SessionReady(rank, 0, 0))
    return state


def restored(state, step, world=None):
    """Every rank of the attempt offers ``step`` from memory: the restore decides it."""
    offers = [sm.RestoreOffered(r, state.attempt, 0, RankOffer.of([step])) for r in range(world or state.world_size)]
    return run(state, *offers)


def commit(state, *steps):
    """Every rank reports each of ``steps`` synced: they commit."""
    actions = []
    for step in steps:
        for rank in range(state.world_size):
            state, more = sm.transition(state, sm.StepSynced(rank, state.attempt, state.gen, step))
            actions += more
    return state, actions


def shrunk(**kw):
    """Node 1 (ranks 2, 3 of 6) lost, the job restarted at world 4, restored step 4."""
    state, _ = run(start(**kw), sm.AgentLost(1), sm.AgentStopped(0, 0), sm.AgentStopped(2, 0))
    state, _ = restored(state, 4)
    return state


def names(actions):
    return [type(a).__name__ for a in actions]


def test_a_node_that_comes_back_grows_the_job_back_exactly_at_a_committed_step():
    state = shrunk()
    state, actions = run(state, sm.AgentJoined(1))
    assert actions == [] and state.world_size == 4  # not at once: at a step boundary
    state, actions = commit(state, 4, 5)  # snapshot 5 (after step index 4) is not surely committed yet
    assert names(actions) == ["CommitStep", "CommitStep"] and state.world_size == 4
    state, actions = commit(state, 6)
    assert names(actions) == ["CommitStep", "ScaleOut", "StopAttempt"]
    grow = actions[1]
    assert (grow.from_world, grow.to_world, grow.agents, grow.step) == (4, 6, (1,), 6)
    assert "the fault-free run's batch" in grow.reason
    assert state.phase is sm.JobPhase.STOPPING and state.world_size == 6
    assert state.placement == (0, 0, 1, 1, 2, 2) and state.data_ranks == () and state.data_world_size == 0
    # the survivors restore what they wrote under their shrunk numbers; node 1's ranks fetch a survivor's
    assert state.restore_ranks == (0, 1, -1, -1, 2, 3)
    assert state.fetch_from == ((-1, -1), (-1, -1), (0, 0), (0, 1), (-1, -1), (-1, -1))
    state, actions = run(state, sm.AgentStopped(0, 1), sm.AgentStopped(1, 1), sm.AgentStopped(2, 1))
    assert actions == [sm.StartAttempt(2)] and state.phase is sm.JobPhase.RUNNING
    assert elastic.ranks_on(state, 1) == [2, 3]
    state, actions = restored(state, 7)
    assert names(actions) == ["RestoreDecided"] and actions[0].point.step == 7
    assert state.growing is None and state.fetch_from == ()  # it held
    for rank in range(6):
        state, _ = sm.transition(state, sm.SessionReady(rank, 2, 0))
    state, actions = run(state, sm.RankExited(3, 2, 1, None))  # a later crash: rung exit, every rank its own
    assert actions[0].rung == "exit" and state.restore_ranks == () and state.world_size == 6


def test_fast_mode_grows_back_with_the_learning_rate_factor_one():
    state = shrunk(elastic_mode="fast", elastic_lr_scaling="linear")
    assert state.lr_scale == 4 / 6
    state, _ = run(state, sm.AgentJoined(1))
    state, actions = commit(state, 4, 5, 6)
    assert "ScaleOut" in names(actions) and "learning-rate factor back to 1" in actions[-2].reason
    assert state.lr_scale == 1.0 and state.data_ranks == () and state.world_size == 6


def test_a_standby_stands_in_for_the_lost_node():
    state = shrunk()
    state, actions = run(state, sm.StandbyJoined(3))
    state, actions = commit(state, 4, 5, 6)
    assert names(actions)[-2:] == ["ScaleOut", "StopAttempt"]
    assert state.placement == (0, 0, 3, 3, 2, 2) and 3 in state.agents and 3 not in state.standbys


def test_no_grow_while_recovering_stopping_or_before_a_shrunk_snapshot():
    state = shrunk()
    state, _ = run(state, sm.AgentJoined(1))
    state, actions = commit(state, 4, 5)
    assert "ScaleOut" not in names(actions)  # the shrunk world's first snapshot may not be committed yet
    stopping, actions = run(state, sm.RankExited(0, 1, 1, None))  # a crash: rung exit stops the attempt
    assert stopping.phase is sm.JobPhase.STOPPING
    stopping, actions = commit(stopping, 6)
    assert actions == [] and stopping.world_size == 4  # no commit, no grow while stopping
    in_flight = start(allowed=("recover-in-place", "elastic", "exit"))
    in_flight, _ = run(in_flight, sm.AgentLost(1), sm.AgentStopped(0, 0), sm.AgentStopped(2, 0))
    in_flight, _ = restored(in_flight, 4)
    for rank in range(4):
        in_flight, _ = sm.transition(in_flight, sm.SessionReady(rank, 1, 0))
    in_flight, _ = commit(in_flight, 4, 5)
    in_flight, actions = run(in_flight, sm.AgentJoined(1), sm.RankExited(1, 1, 1, None))
    assert in_flight.phase is sm.JobPhase.RECOVERING
    in_flight, actions = commit(in_flight, 6)
    assert "ScaleOut" not in names(actions) and in_flight.world_size == 4


def test_a_new_agent_when_not_shrunk_changes_nothing():
    state = start()
    state, actions = run(state, sm.StandbyJoined(3))
    assert actions == [] and state.standbys == frozenset({3})
    state, actions = commit(state, 0, 1, 2)
    assert names(actions) == ["CommitStep"] * 3 and state.world_size == 6 and state.placement == ()


def test_scale_out_refused_loudly_when_off_or_without_fetchable_snapshots():
    for kw, why in [(dict(scale_out=False), "--no-scale-out"),
                    (dict(snapshot_every=0), "the ranks taken in would have no state")]:
        state = shrunk(**kw)
        state, actions = run(state, sm.AgentJoined(1))
        assert names(actions) == ["ScaleOutRefused"] and why in actions[0].reason
        state, actions = commit(state, 4, 5, 6, 7)
        assert "ScaleOut" not in names(actions) and state.world_size == 4


def test_a_scale_out_whose_new_ranks_got_no_state_goes_back_to_the_shrunk_shape():
    state = shrunk()
    state, _ = run(state, sm.AgentJoined(1))
    state, _ = commit(state, 4, 5, 6)
    state, _ = run(state, sm.AgentStopped(0, 1), sm.AgentStopped(1, 1), sm.AgentStopped(2, 1))
    offers = [sm.RestoreOffered(r, 2, 0, RankOffer.of([] if r in (2, 3) else [7])) for r in range(6)]
    state, actions = run(state, *offers)
    assert names(actions) == ["ScaleOutRefused", "StopAttempt"]  # no RestoreDecided(-1): nobody starts fresh
    assert "scale-out undone: the restore found no step every rank can load" in actions[0].reason
    assert state.world_size == 4 and state.placement == (0, 0, 2, 2) and state.restore_ranks == ()
    assert state.data_ranks == ((0, 2), (1, 3), (4,), (5,)) and state.no_grow == frozenset({1})
    state, actions = run(state, sm.AgentStopped(0, 2), sm.AgentStopped(2, 2))
    assert actions == [sm.StartAttempt(3)]
    state, _ = restored(state, 7)
    state, actions = commit(state, 7, 8, 9)
    assert "ScaleOut" not in names(actions)  # not onto the same agent again, until it rejoins
    state, _ = run(state, sm.AgentLost(1), sm.AgentJoined(1))
    state, actions = commit(state, 10)
    assert "ScaleOut" in names(actions)


def test_the_node_taken_in_lost_during_the_scale_out_undoes_it():
    state = shrunk()
    state, _ = run(state, sm.AgentJoined(1))
    state, _ = commit(state, 4, 5, 6)
    state, actions = run(state, sm.AgentLost(1))  # while the attempt stops: not a job failure
    assert names(actions) == ["ScaleOutRefused", "StopAttempt"] and state.world_size == 4
    state, actions = run(state, sm.AgentStopped(0, 1), sm.AgentStopped(2, 1))
    assert actions == [sm.StartAttempt(2)] and state.phase is sm.JobPhase.RUNNING
