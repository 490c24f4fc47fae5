"""The consistency rule, exhaustively: every combination of survivors' phases."""

from __future__ import annotations

import itertools

import pytest

from unbroken.names import STEP_PHASES as PHASES
from unbroken.recovery.consistency import Direction, InconsistentReports, Position, decide

COMMITTED = 9  # the newest step the controller recorded committed in these cases


def _passed(pos: Position) -> int:
    """The newest step whose commit vote this survivor passed, from where it is."""
    return pos.step if pos.phase in ("update", "done") else pos.step - 1


def _possible(pos: Position, committed: int) -> bool:
    """Positions a survivor can really be in when ``committed`` is the newest step whose vote passed."""
    if pos.step == committed:  # inside the committed step: in its vote (gradients whole), or past it
        return pos.phase in ("sync", "update", "done")
    if pos.step == committed + 1:  # inside the next step: not past its reduction
        return pos.phase in ("compute", "sync")
    return False


ALL_POSITIONS = [Position(step, phase) for step in (COMMITTED - 1, COMMITTED, COMMITTED + 1, COMMITTED + 2)
                 for phase in PHASES]


def test_every_combination_of_three_survivors():
    """All 16^3 combinations of (step, phase) for three survivors, around recorded commit 9: the
    commit is the newest of the record and of the votes survivors passed; the job resumes right
    after it; a survivor that passed a step's vote is never rolled back past it, none skips a step."""
    for positions in itertools.product(ALL_POSITIONS, repeat=3):
        survivors = dict(zip((0, 1, 3), positions))  # rank 2 is the dead one
        case = " | ".join(f"{p.step}:{p.phase}" for p in positions)
        committed = max(COMMITTED, *(_passed(p) for p in positions))
        if not all(_possible(p, committed) for p in positions):
            with pytest.raises(InconsistentReports):
                decide(COMMITTED, survivors)
            continue
        decision = decide(COMMITTED, survivors)
        assert decision.resume_step == committed + 1, case  # always the first uncommitted step
        for p in positions:
            assert _passed(p) < decision.resume_step <= p.step + 1, case
        if all(p.step == committed for p in positions):
            assert decision.direction is Direction.ROLL_FORWARD, case
        else:
            assert decision.direction is Direction.ROLL_BACK, case
            assert decision.step_in_flight == committed + 1, case


def test_a_split_vote_rolls_forward():
    # Rank 2 died inside the commit vote of step 10: it completed on rank 0 (now updating), not on
    # rank 1 (paused in it, its gradients whole). The controller had not recorded 10 yet.
    survivors = {0: Position(10, "update"), 1: Position(10, "sync"), 3: Position(11, "compute")}
    decision = decide(COMMITTED, survivors)
    assert decision.resume_step == 11  # rank 1 applies update 10 from its own gradients


def test_a_vote_nobody_alive_passed_rolls_back():
    # Every survivor is in the vote of step 10 and none passed it: nobody alive began update 10.
    survivors = {0: Position(10, "sync"), 1: Position(10, "sync"), 3: Position(10, "sync")}
    decision = decide(COMMITTED, survivors)
    assert (decision.direction, decision.resume_step) == (Direction.ROLL_BACK, 10)


def test_dead_rank_was_the_only_one_that_finished_the_reduction():
    # Rank 2 finished the reduction of step 10 and died before the others did: no survivor passed
    # the vote of step 10 (it needs every rank), so every survivor redoes step 10.
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
