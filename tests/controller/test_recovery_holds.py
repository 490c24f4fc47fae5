"""A recovery counts as done only once every rank completed the step it resumed (issue 32): a rank
that fails again before that is the same fault recurring, and after --max-recurring-recoveries
in-flight tries the ladder goes down to a job restart. And the crash-loop rule sees a deterministic
error whichever rank the ladder saw first."""

from __future__ import annotations

from tests.controller.test_machine import commit, kinds, run, start
from unbroken.controller import machine as sm


def recover_rank_2(state, step):
    """Rank 2 killed in step ``step``; replaced in flight, every rank resumed (rolled back to ``step``)."""
    state, actions = run(state, sm.RankExited(2, 0, None, 9, step=step))
    assert actions[0].rung == "recover-in-place", actions[0].reason
    gen = state.recovery.gen
    state, _ = run(state, *(sm.RankPaused(r, 0, step, "compute") for r in (0, 1, 3)),
                   sm.ReplacementJoined(2, 0, gen))
    state, actions = run(state, *(sm.RankResumed(r, 0, gen) for r in range(4)))
    assert actions == [sm.Recovered(gen, step, frozenset({2}))]
    return state


def test_a_replacement_that_fails_again_before_its_step_completed_is_a_recurring_fault():
    state, _ = commit(start(max_restarts=5), 60)
    state = recover_rank_2(state, 61)
    assert state.unconfirmed == sm.Unconfirmed(1, 61, 1)
    state = recover_rank_2(state, 61)  # fails again in the resumed step: try 2, still in flight
    assert state.unconfirmed.tries == 2
    state, actions = run(state, sm.RankExited(2, 0, None, 6, step=61))  # and again: down the ladder
    assert kinds(actions) == ["Decide", "StopAttempt"] and actions[0].rung == "exit"
    assert "in-flight recovery to step 61 did not hold" in actions[0].reason
    assert "--max-recurring-recoveries" in actions[0].reason
    state, actions = run(state, sm.AgentStopped(0, 0))
    assert actions == [sm.StartAttempt(1)] and state.unconfirmed is None


def test_a_recovery_holds_once_the_step_after_the_resumed_one_commits():
    state, _ = commit(start(), 60)
    state = recover_rank_2(state, 61)
    state, actions = run(state, *(sm.StepSynced(r, 0, 1, 61) for r in range(4)))
    assert actions == [sm.CommitStep(1, 61)] and state.unconfirmed is not None  # the update of 61 may fail yet
    state, actions = run(state, *(sm.StepSynced(r, 0, 1, 62) for r in range(4)))
    assert actions == [sm.CommitStep(1, 62), sm.RecoveryHeld(1, 61)] and state.unconfirmed is None
    state = recover_rank_2(state, 63)  # a later fault is a new one: try 1 again
    assert state.unconfirmed.tries == 1


def test_the_bound_is_a_setting():
    state, _ = commit(start(max_restarts=5, max_recurring=1), 60)
    state = recover_rank_2(state, 61)
    state, actions = run(state, sm.RankExited(0, 0, 1, None, step=61))  # a survivor this time
    assert actions[0].rung == "exit" and "at most 1" in actions[0].reason


def test_a_script_error_on_every_rank_is_a_crash_loop_whichever_rank_fails_first():
    """Case 5 of issue 32: each attempt a different rank is seen first, with its rank in the line."""
    state = start(max_restarts=200, allowed=("exit",))
    for attempt, rank in enumerate((3, 0)):
        line = (f"[rank {rank}] RuntimeError: shape mismatch in step 1",)
        state, actions = run(state, sm.RankExited(rank, attempt, 1, None, step=1, last_lines=line))
        assert actions[0].rung == "exit"
        state, _ = run(state, sm.AgentStopped(0, attempt))
    state, actions = run(state, sm.RankExited(1, 2, 1, None, step=1,
                                              last_lines=("[rank 1] RuntimeError: shape mismatch in step 1",)))
    assert state.phase is sm.JobPhase.FAILED
    (finish,) = [a for a in actions if isinstance(a, sm.Finish)]
    assert finish.exit_code == 1 and "crash loop" in finish.reason and "shape mismatch" in finish.reason


def test_several_ranks_failing_alike_in_one_episode_count_once():
    """Survivors failing the same way while one fault is recovered are one episode, not a loop."""
    state, _ = commit(start(max_restarts=5), 4)
    line = ("RuntimeError: Connection closed by peer",)
    state, actions = run(state, sm.RankExited(1, 0, 1, None, step=5, last_lines=line))
    state, actions = run(state, sm.RankExited(2, 0, 1, None, step=5, last_lines=line))
    state, actions = run(state, sm.RankExited(3, 0, 1, None, step=5, last_lines=line))
    assert state.phase is not sm.JobPhase.FAILED
    assert not any(isinstance(a, sm.Finish) for a in actions)


def test_an_attempt_that_saw_only_a_hang_kill_does_not_break_a_crash_loop():
    state = start(max_restarts=200, allowed=("exit",))
    line = ("ValueError: rank 0: batch 1 has the wrong shape",)
    for attempt in range(4):
        if attempt == 1:  # the erring rank was slow to exit: killed as hung, its peer's error unseen
            state, _ = run(state, sm.RankHung(0, attempt, 1, 5.0), sm.RankExited(0, attempt, None, 9, step=1))
        else:
            state, _ = run(state, sm.RankExited(attempt % 2, attempt, 1, None, step=1, last_lines=line))
        if state.phase is sm.JobPhase.FAILED:
            break
        state, _ = run(state, sm.AgentStopped(0, attempt))
    assert state.phase is sm.JobPhase.FAILED and attempt == 3
