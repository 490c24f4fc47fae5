"""The state machine for retry-type faults (memory, non-finite, silent corruption) and sub-health."""

from __future__ import annotations

import pytest

from tests.controller.test_machine import commit, kinds, run, start
from unbroken.controller import machine as sm

RETRY_FIRST = ("retry", "recover-in-place", "exit")


@pytest.mark.parametrize("kind", ["memory-fault", "non-finite", "sdc"])
def test_a_retry_type_fault_is_repaired_in_place_without_a_restart(kind):
    state, _ = commit(start(allowed=RETRY_FIRST), 4)
    state, actions = run(state, sm.RankDamaged(1, 0, "what", kind, step=5))
    assert kinds(actions) == ["Decide", "AbortGeneration"]  # no RestartRanks, no KillRank
    assert actions[0].rung == "retry" and actions[0].failure.kind == kind
    assert state.recovery.replaced == frozenset({1})


def test_retry_not_allowed_kills_the_damaged_rank_for_the_next_rung():
    state, _ = commit(start(allowed=("recover-in-place", "exit")), 4)
    state, actions = run(state, sm.RankDamaged(1, 0, "nan", "non-finite", step=5))
    assert kinds(actions) == ["Decide", "KillRank"] and actions[1].rank == 1


def test_a_second_rank_reporting_damage_before_the_regroup_is_repaired_too():
    state, _ = commit(start(allowed=RETRY_FIRST), 4)
    state, _ = run(state, sm.RankDamaged(1, 0, "nan", "non-finite", step=5))
    state, actions = run(state, sm.RankDamaged(3, 0, "nan", "non-finite", step=5))
    assert actions == [] and state.recovery.replaced == frozenset({1, 3})
    state, actions = run(state, sm.RankPaused(0, 0, 5, "compute"), sm.RankPaused(2, 0, 5, "sync"),
                         sm.ReplacementJoined(1, 0, 1), sm.ReplacementJoined(3, 0, 1))
    (regroup,) = actions
    assert regroup.replaced == frozenset({1, 3}) and regroup.resume_step == 5


def test_sub_health_is_ignored_by_default():
    state, _ = commit(start(can_dump=True), 4)
    state, actions = run(state, sm.RankDegraded(2, 0, "ecc warnings", step=5))
    assert actions == [] and state.phase is sm.JobPhase.RUNNING


def test_sub_health_grace_exit_dumps_every_rank_then_restarts():
    state, _ = commit(start(can_dump=True, sub_health_policy="grace-exit"), 4)
    state, actions = run(state, sm.RankDegraded(2, 0, "ecc warnings", step=5))
    assert kinds(actions) == ["Decide", "AbortGeneration"] and actions[0].rung == "dump"
    assert "ecc warnings" in actions[0].reason and state.recovery.replaced == frozenset()
    state, actions = run(state, *(sm.RankPaused(r, 0, 5, "compute") for r in range(4)))
    (order,) = actions
    assert isinstance(order, sm.DumpOrder) and order.step == 5 and order.assign == ()
    state, actions = run(state, *(sm.StepDumped(r, 0, 5, (r,), "") for r in range(4)))
    assert kinds(actions) == ["CommitDump", "Decide", "StopAttempt"]
    assert actions[1].rung == "exit" and actions[1].failure.kind == "sub-health-dumped"
    assert state.phase is sm.JobPhase.STOPPING


def test_sub_health_dump_refused_still_restarts_cleanly():
    state, _ = commit(start(can_dump=True, sub_health_policy="grace-exit"), 4)
    state, _ = run(state, sm.RankDegraded(2, 0, "slow", step=5),
                   *(sm.RankPaused(r, 0, 5, "compute") for r in range(4)))
    state, actions = run(state, sm.StepDumped(0, 0, 5, (0,), "disk full"))
    assert kinds(actions) == ["Decide", "Decide", "StopAttempt"] and actions[1].rung == "exit"
    assert "disk full" in actions[0].reason


def test_sub_health_without_storage_is_a_clean_restart():
    state, _ = commit(start(sub_health_policy="grace-exit"), 4)
    state, actions = run(state, sm.RankDegraded(2, 0, "slow", step=5))
    assert kinds(actions) == ["Decide", "StopAttempt"] and actions[0].rung == "exit"
    assert "no storage tier" in actions[0].reason


def test_the_same_failure_three_times_in_a_row_is_a_crash_loop():
    state = start(max_restarts=100, allowed=("exit",))
    boom = ("Traceback (most recent call last):", "ValueError: batch 7 is empty")
    for attempt in range(2):
        state, actions = run(state, sm.RankExited(1, attempt, 1, None, step=7, last_lines=boom))
        assert kinds(actions) == ["Decide", "StopAttempt"] and actions[0].rung == "exit"
        state, _ = run(state, sm.AgentStopped(0, attempt))
    state, actions = run(state, sm.RankExited(1, 2, 1, None, step=7, last_lines=boom))
    assert state.phase is sm.JobPhase.FAILED
    (finish,) = [a for a in actions if isinstance(a, sm.Finish)]
    assert "crash loop" in finish.reason and "batch 7 is empty" in finish.reason


def test_different_failures_are_no_crash_loop():
    state = start(max_restarts=100, allowed=("exit",))
    for attempt, step in enumerate((7, 8, 9)):
        state, actions = run(state, sm.RankExited(1, attempt, 1, None, step=step, last_lines=("ValueError",)))
        assert actions[0].rung == "exit"
        state, _ = run(state, sm.AgentStopped(0, attempt))
    assert state.phase is sm.JobPhase.RUNNING


def test_a_lost_ranks_dump_is_written_by_a_survivor_holding_its_replica():
    """Rung `dump` after a lost rank: the order names, per lost rank, the lowest survivor that holds
    every piece of its state (N = 2 replicas over 4 ranks: shard 2 lives on ranks 0 and 2)."""
    state, _ = commit(start(replicas=2, can_dump=True, allowed=("dump", "exit")), 4)
    state, actions = run(state, sm.RankExited(2, 0, None, 9, step=5))
    assert kinds(actions) == ["Decide", "AbortGeneration"] and actions[0].rung == "dump"
    state, actions = run(state, *(sm.RankPaused(r, 0, 5, "compute") for r in (0, 1, 3)))
    (order,) = actions
    assert isinstance(order, sm.DumpOrder) and order.step == 5 and order.assign == ((2, 0),)
    state, actions = run(state, *(sm.StepDumped(r, 0, 5, (r, 2) if r == 0 else (r,), "") for r in (0, 1, 3)))
    assert kinds(actions)[0] == "CommitDump" and actions[0].step == 5


def test_a_dump_with_a_survivor_behind_is_refused():
    """A rank cut inside the reduction of a step a peer updated holds no copy of that step to write."""
    state, _ = commit(start(can_dump=True, sub_health_policy="grace-exit"), 4)
    state, _ = run(state, sm.RankDegraded(2, 0, "ecc warnings", step=5))
    state, actions = run(state, sm.RankPaused(0, 0, 5, "update"), sm.RankPaused(1, 0, 5, "sync", cut=""),
                         sm.RankPaused(2, 0, 6, "compute"), sm.RankPaused(3, 0, 5, "done"))
    assert kinds(actions)[:2] == ["Decide", "Decide"] and "hold no copy of its result" in actions[0].reason
