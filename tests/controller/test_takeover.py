"""The new leader's start from the durable state (controller/takeover.py): pure, no processes."""

from __future__ import annotations

from dataclasses import replace

from unbroken.consensus.durable import DurableState
from unbroken.controller import machine as sm
from unbroken.controller import takeover as tk
from unbroken.recovery.policy import JobPolicy

POLICY = JobPolicy(max_restarts=5, allowed=("recover", "exit"))
# 2 nodes of 2 ranks; node 0's agent hosted the controller that was lost
DURABLE = DurableState(attempt=1, generation=2, committed_step=7, restart_budget=4,
                       rank_state_at={0: "agent0", 1: "agent0", 2: "agent1", 3: "agent1"})


def fresh() -> sm.JobState:
    return sm.JobState(POLICY, world_size=4, nnodes=2)


def test_resumed_restarts_the_job_with_the_last_leaders_bookkeeping():
    state = tk.resumed(fresh(), DURABLE)
    assert state.phase is sm.JobPhase.STARTING
    assert state.attempt == 2  # a new attempt: nothing of the old one can act in it
    assert state.restarts_used == 2  # 1 used before, and this restart
    assert state.placement == (0, 0, 1, 1)
    assert state.gen == 0 and state.committed_step == -1


def test_the_lost_nodes_ranks_move_to_a_standby_once_the_survivors_rejoined():
    state = tk.resumed(fresh(), DURABLE)
    lost = frozenset({0})
    state, actions = sm.transition(state, sm.StandbyJoined(2))
    state, actions = tk.place(state, lost)
    assert actions == [] and state.phase is sm.JobPhase.STARTING  # node 1 has not rejoined yet
    state, actions = sm.transition(state, sm.AgentJoined(1))
    assert actions == []  # the machine alone waits for node 0 ...
    state, actions = tk.place(state, lost)  # ... the takeover knows it is lost
    assert actions == [sm.StartAttempt(2)]
    assert state.phase is sm.JobPhase.RUNNING
    assert state.placement == (2, 2, 1, 1) and state.standbys == frozenset() and state.agents == {1, 2}


def test_without_a_standby_it_waits_then_fails_saying_why():
    state = tk.resumed(fresh(), DURABLE)
    state, _ = sm.transition(state, sm.AgentJoined(1))
    state, actions = tk.place(state, frozenset({0}))
    assert actions == []
    state, actions = tk.window_over(state, frozenset({0}), 5.0)
    assert state.phase is sm.JobPhase.FAILED
    finish = actions[-1]
    assert isinstance(finish, sm.Finish) and finish.exit_code == 1
    assert "nodes [0]" in finish.reason and "standby" in finish.reason and "rank 0" in finish.reason


def test_a_host_that_does_not_rejoin_in_the_window_is_lost_too():
    state = tk.resumed(fresh(), DURABLE)
    state, _ = sm.transition(state, sm.StandbyJoined(2))
    state, actions = tk.place(state, frozenset())  # no previous leader known: node 0 may come back
    assert actions == []
    state, _ = sm.transition(state, sm.AgentJoined(1))
    state, actions = tk.window_over(state, frozenset(), 5.0)
    assert actions == [sm.StartAttempt(2)] and state.placement == (2, 2, 1, 1)


def test_no_restart_left_fails_the_job():
    state = tk.resumed(fresh(), replace(DURABLE, restart_budget=0))
    state, _ = sm.transition(state, sm.AgentJoined(1))
    state, actions = tk.place(state, frozenset({0}))
    assert state.phase is sm.JobPhase.FAILED
    assert "restart budget is spent" in actions[-1].reason
