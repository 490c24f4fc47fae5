"""The state machine's immutable values (controller/values.py): RankSet reads as the frozenset
of the same ranks, Chain is a persistent list, replace copies a frozen dataclass."""

from __future__ import annotations

import dataclasses
import random

import pytest

from unbroken.controller import machine as sm
from unbroken.controller.values import Chain, RankSet, replace

pytestmark = pytest.mark.timeout(30)


def test_a_rank_set_answers_every_set_question_as_the_frozenset_would():
    rng = random.Random(7)
    for _ in range(300):
        a = frozenset(rng.sample(range(200), rng.randrange(0, 30)))
        b = frozenset(rng.sample(range(200), rng.randrange(0, 30)))
        ra, rb = RankSet(a), RankSet(b)
        assert ra == a and a == ra and hash(ra) == hash(a) and len(ra) == len(a) and bool(ra) == bool(a)
        assert sorted(ra) == sorted(a) and list(ra) == sorted(a)  # iteration is ascending
        for other in (rb, b, set(b)):
            assert ra | other == a | b and other | ra == a | b
            assert ra & other == a & b and ra - other == a - b and other & ra == a & b
            assert (ra <= other) == (a <= b) and (ra >= other) == (a >= b)
        assert b - ra == b - a
        for left in (b, set(b)):  # a builtin set on the left keeps its type (set.intersection needs a set)
            assert all(type(op) is type(left) for op in (left | ra, left & ra, left - ra))
        assert set.intersection(set(b) & ra, set(a)) == a & b
        for r in rng.sample(range(200), 10):
            assert (r in ra) == (r in a)
            assert ra.with_rank(r) == a | {r}
    assert ra != RankSet(a | {999}) and ra != "not a set" and -1 not in ra and "1" not in ra


def test_a_rank_set_is_immutable_and_refuses_negative_ranks():
    s = RankSet({1, 2})
    with pytest.raises(AttributeError):
        s._mask = 0
    with pytest.raises(ValueError, match="ranks >= 0"):
        RankSet({-1})
    with pytest.raises(ValueError, match="ranks >= 0"):
        s.with_rank(-3)
    assert s.with_rank(5) == {1, 2, 5} and s == {1, 2}  # the old one stays
    with pytest.raises(ValueError, match="ranks >= 0"):
        s | {-1}
    assert s & {-1, 1} == {1} and s - {-1} == s and s <= {-1, 1, 2} and not s >= {-1}
    assert RankSet.full(4) == {0, 1, 2, 3} and RankSet.full(0) == frozenset()


def test_a_chain_is_a_persistent_list_newest_first():
    empty = Chain()
    one = empty.push("a")
    two = one.push("b")
    assert list(empty) == [] and list(one) == ["a"] and list(two) == ["b", "a"] and len(two) == 2
    assert list(one.push("c")) == ["c", "a"] and list(two) == ["b", "a"]


def test_replace_copies_a_frozen_dataclass_and_refuses_unknown_fields():
    state = sm.JobState(sm.JobPolicy(max_restarts=1), world_size=4)
    new = replace(state, gen=3, committed_step=7)
    assert (new.gen, new.committed_step, state.gen, state.committed_step) == (3, 7, 0, -1)
    assert new == dataclasses.replace(state, gen=3, committed_step=7)
    with pytest.raises(dataclasses.FrozenInstanceError):
        new.gen = 4
    with pytest.raises(TypeError, match="no field"):
        replace(state, generation=3)


def test_a_survivor_that_pauses_twice_counts_with_its_latest_position():
    """The pause positions are a chain now: a second pause of one rank (it reported again) must
    shadow its first, as the tuple that dropped the old entry did."""
    state = sm.JobState(sm.JobPolicy(max_restarts=3, allowed=("recover-in-place",)), world_size=3)
    state, _ = sm.transition(state, sm.AgentJoined(0))
    for r in range(3):
        state, _ = sm.transition(state, sm.SessionReady(r, 0, 0))
    for r in range(3):
        state, _ = sm.transition(state, sm.StepSynced(r, 0, 0, 4))
    state, _ = sm.transition(state, sm.RankExited(2, 0, None, 9, step=4))
    state, _ = sm.transition(state, sm.RankPaused(0, 0, 4, "update"))  # its first report, then a later one
    state, _ = sm.transition(state, sm.RankPaused(0, 0, 5, "compute"))
    state, _ = sm.transition(state, sm.RankPaused(1, 0, 4, "update"))
    state, actions = sm.transition(state, sm.ReplacementJoined(2, 0, 1))
    (order,) = actions
    assert order.resume_step == 5 and order.direction == "roll-back"  # with rank 0 at (4, update): roll-forward
