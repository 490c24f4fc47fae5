"""The controller's copy of each rank's own state: which capture a replacement gets."""

from __future__ import annotations

from unbroken.controller.rank_state import Point, RankStates


def test_the_start_of_the_resume_step_wins_then_the_state_after_computing_the_one_before():
    states = RankStates(limit_bytes=100)
    states.note(1, 0, 7, Point.START, b"s7")
    states.note(1, 0, 7, Point.AFTER_COMPUTE, b"c7")
    assert states.for_resume(1, 0, 7).state == b"s7"  # rolled back: the start of 7
    assert states.for_resume(1, 0, 8).state == b"c7"  # rolled forward: what rank 1 had when 7 committed
    assert "after compute of step 7" in states.for_resume(1, 0, 8).source
    states.note(1, 0, 8, Point.START, b"s8")
    assert states.for_resume(1, 0, 8).state == b"s8"
    assert states.for_resume(1, 0, 6) is None
    assert states.for_resume(2, 0, 8) is None  # another rank's is never handed out


def test_only_the_newest_two_steps_are_kept_and_a_new_attempt_drops_the_old_ones():
    states = RankStates(limit_bytes=100)
    for step in range(5):
        states.note(0, 0, step, Point.START, b"s%d" % step)
        states.note(0, 0, step, Point.AFTER_COMPUTE, b"c%d" % step)
    assert states.held_bytes() == 4 * 2
    assert states.for_resume(0, 0, 3).state == b"s3" and states.for_resume(0, 0, 2) is None
    states.note(0, 1, 1, Point.START, b"n1")  # a job restart resumed at an older step
    assert states.for_resume(0, 1, 1).state == b"n1"
    assert states.for_resume(0, 1, 4) is None and states.for_resume(0, 0, 4) is None
    states.note(0, 0, 9, Point.START, b"late")  # a late report of the older attempt
    assert states.for_resume(0, 1, 9) is None


def test_a_capture_over_the_limit_is_not_kept_and_drops_the_older_ones():
    states = RankStates(limit_bytes=4)
    states.note(3, 0, 1, Point.START, b"ok")
    states.note(3, 0, 2, Point.START, b"too big")
    assert states.for_resume(3, 0, 1) is None and states.for_resume(3, 0, 2) is None
