"""The consistency rule, exhaustively: every combination of survivors' phases."""

from __future__ import annotations

import itertools

import pytest

from unbroken.names import STEP_PHASES as PHASES
from unbroken.recovery.consistency import Direction, InconsistentReports, Position, decide

COMMITTED = 9  # the newest committed step in these cases


def _possible(pos: Position) -> bool:
    """Positions a survivor can really be in when step COMMITTED is the newest commit."""
    if pos.step == COMMITTED:  # inside the committed step: past its reduction
        return pos.phase in ("update", "done")
    if pos.step == COMMITTED + 1:  # inside the next step: not past its reduction
        return pos.phase in ("compute", "sync")
    return False


ALL_POSITIONS = [Position(step, phase) for step in (COMMITTED - 1, COMMITTED, COMMITTED + 1, COMMITTED + 2)
                 for phase in PHASES]


def test_every_combination_of_three_survivors():
    """All 16^3 combinations of (step, phase) for three survivors, around commit 9."""
    for positions in itertools.product(ALL_POSITIONS, repeat=3):
        survivors = dict(zip((0, 1, 3), positions))  # rank 2 is the dead one
        case = " | ".join(f"{p.step}:{p.phase}" for p in positions)
        if not all(_possible(p) for p in positions):
            with pytest.raises(InconsistentReports):
                decide(COMMITTED, survivors)
            continue
        decision = decide(COMMITTED, survivors)
        assert decision.resume_step == COMMITTED + 1, case  # always the first uncommitted step
        if all(p.step == COMMITTED for p in positions):
            assert decision.direction is Direction.ROLL_FORWARD, case
        else:
            assert decision.direction is Direction.ROLL_BACK, case
            assert decision.step_in_flight == COMMITTED + 1, case


def test_dead_rank_was_the_only_one_that_finished_the_reduction():
    # Rank 2 finished the reduction of step 10 and died before the others did: step 10 was
    # never committed (commit needs every rank), so every survivor redoes step 10.
    survivors = {0: Position(10, "sync"), 1: Position(10, "sync"), 3: Position(10, "compute")}
    decision = decide(COMMITTED, survivors)
    assert (decision.direction, decision.resume_step) == (Direction.ROLL_BACK, 10)


def test_committed_step_rolls_forward_when_a_survivor_is_still_updating():
    survivors = {0: Position(9, "update"), 1: Position(10, "sync"), 3: Position(9, "done")}
    decision = decide(COMMITTED, survivors)
    assert decision.resume_step == 10  # step 9 completes everywhere; step 10 is redone


def test_no_survivor_is_an_error():
    with pytest.raises(ValueError):
        decide(COMMITTED, {})


def test_unknown_phase_is_rejected():
    with pytest.raises(ValueError, match="unknown phase"):
        Position(3, "thinking")
