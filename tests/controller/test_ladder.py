"""The recovery ladder takes only rungs the job allows (issue 11, item 15)."""

from __future__ import annotations

import itertools

from tests.controller.test_machine import kinds, run, start
from unbroken.controller import machine as sm
from unbroken.recovery.ladder import GIVE_UP, RUNGS, choose_rung


def test_a_feasible_rung_that_is_not_allowed_is_never_taken():
    assert choose_rung(("recover-in-place",), {"recover-in-place": False, "exit": True}) == GIVE_UP
    assert choose_rung(("dump",), {"exit": True, "dump": False}) == GIVE_UP


def test_the_first_allowed_and_feasible_rung_is_taken_for_every_combination():
    for allowed_bits, feasible_bits in itertools.product(range(2 ** len(RUNGS)), repeat=2):
        allowed = tuple(r for i, r in enumerate(RUNGS) if allowed_bits >> i & 1)
        feasible = {r: bool(feasible_bits >> i & 1) for i, r in enumerate(RUNGS)}
        expected = next((r for r in RUNGS if r in allowed and feasible[r]), GIVE_UP)
        assert choose_rung(allowed, feasible) == expected, (allowed, feasible)


def test_no_allowed_rung_feasible_fails_the_job_with_that_reason_and_restarts_nothing():
    state = sm.JobState(world_size=2, nnodes=1, max_restarts=5, allowed=("recover-in-place",))
    # rank 1 never ran a step loop: in-flight recovery is infeasible, `exit` is not allowed
    state, _ = run(state, sm.AgentJoined(0), sm.SessionReady(0, 0, 0))
    state, actions = run(state, sm.WorkerExited(1, 0, 1, None))
    assert state.phase is sm.JobPhase.FAILED and state.restarts_used == 0
    assert actions[0].rung == GIVE_UP and "exit" not in [getattr(a, "rung", None) for a in actions]
    (finish,) = [a for a in actions if isinstance(a, sm.Finish)]
    assert finish.exit_code == 1
    assert "none of the allowed strategies (recover-in-place; --recover-strategy)" in finish.reason
    assert "do not run an unbroken step loop" in finish.reason


def test_in_flight_tries_spent_without_exit_allowed_fails_the_job():
    state = start(allowed=("recover-in-place",), crash_loop_limit=0)
    for _ in range(state.max_recovery_tries):
        state, actions = run(state, sm.WorkerExited(2, 0, None, 9))
        assert actions[0].rung == "recover-in-place"
    state, actions = run(state, sm.WorkerExited(2, 0, None, 9))
    assert kinds(actions)[-1] == "Finish" and state.phase is sm.JobPhase.FAILED
    assert f"in-flight recovery tried {state.max_recovery_tries} times" in actions[-1].reason
