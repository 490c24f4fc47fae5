"""choose_rung: the recovery ladder as a pure function (milliseconds, no processes)."""

from __future__ import annotations

from unbroken.names import RUNGS, Rung
from unbroken.recovery.ladder import GIVE_UP, choose_rung

ALL = {rung: True for rung in RUNGS}


def test_the_cheapest_allowed_feasible_rung_wins():
    assert choose_rung(list(RUNGS), ALL) == Rung.RETRY
    assert choose_rung(["recover", "recover-in-place"], ALL) == Rung.RECOVER_IN_PLACE  # ladder order, not list order


def test_an_infeasible_rung_falls_to_the_next_allowed_one():
    feasible = dict(ALL, **{"retry": False, "recover-in-place": False})
    assert choose_rung(["retry", "recover-in-place", "recover"], feasible) == Rung.RECOVER


def test_exit_is_implicitly_allowed_but_must_be_feasible():
    assert choose_rung(["retry"], {"retry": False, "exit": True}) == Rung.EXIT
    assert choose_rung(["retry"], {"retry": False, "exit": False}) == GIVE_UP
    assert choose_rung(["retry"], {}) == GIVE_UP  # missing means not feasible


def test_after_starts_below_the_rung_that_failed():
    assert choose_rung(list(RUNGS), ALL, after="recover-in-place") == Rung.RECOVER
    assert choose_rung(list(RUNGS), ALL, after="exit") == GIVE_UP


def test_plain_strings_and_the_enum_are_the_same_rung():
    assert choose_rung(("recover-in-place",), {Rung.RECOVER_IN_PLACE: True}) == "recover-in-place"
