"""choose_rung: the recovery ladder as a pure function (milliseconds, no processes); it takes
only rungs the job allows (issue 11, item 15), ``exit`` included."""

from __future__ import annotations

import itertools

from tests.controller.test_machine import kinds, run, start
from unbroken.controller import machine as sm
from unbroken.names import RUNGS, Rung
from unbroken.recovery.ladder import GIVE_UP, choose_rung

ALL = {rung: True for rung in RUNGS}


def test_the_cheapest_allowed_feasible_rung_wins():
    assert choose_rung(list(RUNGS), ALL) == Rung.RETRY
    assert choose_rung(["recover", "recover-in-place"], ALL) == Rung.RECOVER_IN_PLACE  # ladder order, not list order


def test_an_infeasible_rung_falls_to_the_next_allowed_one():
    feasible = dict(ALL, **{"retry": False, "recover-in-place": False})
    assert choose_rung(["retry", "recover-in-place", "recover"], feasible) == Rung.RECOVER


def test_exit_is_taken_only_when_allowed_and_feasible():
    assert choose_rung(["retry", "exit"], {"retry": False, "exit": True}) == Rung.EXIT
    assert choose_rung(["retry", "exit"], {"retry": False, "exit": False}) == GIVE_UP
    assert choose_rung(["retry", "exit"], {}) == GIVE_UP  # missing means not feasible


def test_a_feasible_rung_that_is_not_allowed_is_never_taken():
    assert choose_rung(("recover-in-place",), {"recover-in-place": False, "exit": True}) == GIVE_UP
    assert choose_rung(("dump",), {"exit": True, "dump": False}) == GIVE_UP
    assert choose_rung(["retry"], {"retry": False, "exit": True}) == GIVE_UP  # no implicit exit


def test_the_first_allowed_and_feasible_rung_is_taken_for_every_combination():
    for allowed_bits, feasible_bits in itertools.product(range(2 ** len(RUNGS)), repeat=2):
        allowed = tuple(r for i, r in enumerate(RUNGS) if allowed_bits >> i & 1)
        feasible = {r: bool(feasible_bits >> i & 1) for i, r in enumerate(RUNGS)}
        expected = next((r for r in RUNGS if r in allowed and feasible[r]), GIVE_UP)
        assert choose_rung(allowed, feasible) == expected, (allowed, feasible)


def test_after_starts_below_the_rung_that_failed():
    assert choose_rung(list(RUNGS), ALL, after="recover-in-place") == Rung.RECOVER
    assert choose_rung(list(RUNGS), ALL, after="exit") == GIVE_UP


def test_plain_strings_and_the_enum_are_the_same_rung():
    assert choose_rung(("recover-in-place",), {Rung.RECOVER_IN_PLACE: True}) == "recover-in-place"


def test_no_allowed_rung_feasible_fails_the_job_with_that_reason_and_restarts_nothing():
    state = sm.JobState(sm.JobPolicy(max_restarts=5, allowed=("recover-in-place",)), world_size=2)
    # rank 1 never ran a step loop: in-flight recovery is infeasible, `exit` is not allowed
    state, _ = run(state, sm.AgentJoined(0), sm.SessionReady(0, 0, 0))
    state, actions = run(state, sm.RankExited(1, 0, 1, None))
    assert state.phase is sm.JobPhase.FAILED and state.restarts_used == 0
    assert actions[0].rung == GIVE_UP and "exit" not in [getattr(a, "rung", None) for a in actions]
    (finish,) = [a for a in actions if isinstance(a, sm.Finish)]
    assert finish.exit_code == 1
    assert "none of the allowed strategies (recover-in-place; --recover-strategy)" in finish.reason
    assert "have not committed a step through unbroken" in finish.reason


def test_in_flight_tries_spent_without_exit_allowed_fails_the_job():
    state = start(allowed=("recover-in-place",), crash_loop_limit=0)
    for _ in range(state.policy.max_recovery_tries):
        state, actions = run(state, sm.RankExited(2, 0, None, 9))
        assert actions[0].rung == "recover-in-place"
    state, actions = run(state, sm.RankExited(2, 0, None, 9))
    assert kinds(actions)[-1] == "Finish" and state.phase is sm.JobPhase.FAILED
    assert f"in-flight tries used, at most {state.policy.max_recovery_tries}" in actions[-1].reason
