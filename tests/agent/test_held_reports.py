"""What a node's agent holds of its ranks' steady step reports, and its summary (agent/held_reports.py).
Pure: reports in, decisions and summaries out, times given."""

from __future__ import annotations

import pytest

from unbroken.agent.held_reports import HOLD_AFTER, KEEP, STALL_FLOOR_S, HeldReports, Report
from unbroken.controller.health import WINDOW
from unbroken.protocol import messages as m

pytestmark = pytest.mark.timeout(20)


def _done(rank: int, step: int, t: float, *, state: bytes = b"", same: bool = False, moved: bool = False,
          compute_s: float = 0.1, pid: int | None = None) -> Report:
    """Rank ``rank``'s compute report of ``step``, folding in that it completed ``step`` steps."""
    msg = m.Progress(rank=rank, attempt=0, step=step, phase="compute", done=True, synced=True, moved=moved,
                     metrics={"step_s": 0.2, "ckpt_s": 0.0, "compute_s": compute_s},
                     state=state or (b"" if same else b"s%d-%d" % (rank, step)), state_same=same)
    return Report(rank, 1000 + rank if pid is None else pid, msg, t, ("compute", step))


def _steady(held: HeldReports, rank: int, steps: range, t0: float = 0.0, dt: float = 0.1) -> list[bool]:
    return [held.take(_done(rank, s, t0 + i * dt)) for i, s in enumerate(steps)]


def test_a_ranks_steady_reports_are_held_after_a_few_went_on_and_only_the_newest_are_kept():
    held = HeldReports()
    taken = _steady(held, 0, range(1, 10))
    assert taken == [False] * HOLD_AFTER + [True] * (9 - HOLD_AFTER)  # the first ones go on (the controller sees them)
    out = held.release()
    assert [r.msg.step for r in out] == list(range(10 - KEEP, 10))  # the newest, oldest first
    assert held.release() == []
    assert held.take(_done(0, 10, 1.0)) is False  # holding starts over after a release of all


def test_a_report_that_says_its_state_is_the_last_one_is_held_with_that_state_written_out():
    held = HeldReports()
    _steady(held, 0, range(1, 1 + HOLD_AFTER))  # went on: the last carried b"s0-3"
    assert held.take(_done(0, 4, 1.0, same=True))
    assert held.take(_done(0, 5, 1.1, state=b"new"))
    assert held.take(_done(0, 6, 1.2, same=True))
    assert [(r.msg.state, r.msg.state_same) for r in held.release()] == [
        (b"s0-3", False), (b"new", False), (b"new", False)]  # never "the last one": that may not reach the controller


def test_an_unknown_last_state_a_moved_state_and_other_reports_go_on():
    held = HeldReports()
    for i in range(HOLD_AFTER + 2):  # a new process whose reports all say "same": nothing to write out
        assert held.take(_done(0, i + 1, i * 0.1, same=True)) is False
    _steady(held, 1, range(1, 6))
    assert held.take(_done(1, 6, 1.0, moved=True)) is False  # its own state moved after the update: the controller
    pause = Report(1, 1001, m.RankPaused(rank=1, attempt=0, gen=1, step=7, phase="compute"), 1.1)
    assert held.take(pause) is False
    assert held.must_release(pause) is None  # a pause (a mark, the loop's end): every rank's held reports first
    synced = Report(1, 1001, m.StepSynced(rank=1, attempt=0, gen=0, step=6), 1.2)
    assert held.must_release(synced) == [1]  # a voting step's commit report: its own rank's first


def test_a_new_process_of_a_rank_starts_over():
    held = HeldReports()
    _steady(held, 0, range(1, 8))
    assert held.take(_done(0, 8, 1.0, pid=4242)) is False  # a replacement: its first reports go on


def test_a_stall_is_some_rank_silent_past_the_stall_time_while_reports_are_held():
    held = HeldReports()
    for r in (0, 1):
        _steady(held, r, range(1, 8), dt=0.1)
    last = 0.6
    assert not held.stalled(last + STALL_FLOOR_S - 0.01)
    assert held.stalled(last + STALL_FLOOR_S + 0.01)
    held.release()
    assert not held.stalled(last + 100)  # nothing held: nothing to send


def test_the_stall_time_grows_with_the_nodes_slowest_step():
    held = HeldReports()
    _steady(held, 0, range(1, 8), dt=2.0)  # 2 s steps: a stall only after 1.5 x that
    last = 6 * 2.0
    assert not held.stalled(last + 2.9)
    assert held.stalled(last + 3.1)


def test_the_summary_says_the_fewest_steps_and_the_least_recent_report_once_a_second():
    held = HeldReports(summary_s=1.0)
    assert held.summary(0.0) is None  # nobody reported
    held.take(_done(0, 5, 0.0))
    held.take(Report(1, 1001, m.Progress(rank=1, attempt=0, step=0, phase="compute", metrics={}), 0.0))
    assert held.summary(2.0) is None  # rank 1 has not completed a step yet
    held.take(_done(1, 4, 0.3))
    s = held.summary(2.0)
    assert (s.attempt, s.nranks, s.done, s.age_s, s.step_s) == (0, 2, 4, 2.0, 0.2)
    assert s.slow_rank == -1  # fewer than WINDOW compute times each
    assert held.summary(2.5) is None  # nothing new
    held.take(_done(1, 5, 2.6))
    assert held.summary(2.7) is None  # not a second since the last one
    assert held.summary(3.0).done == 5


def test_the_summary_names_the_slowest_rank_once_each_has_its_window_of_compute_times():
    held = HeldReports(summary_s=0.0)
    for rank, compute_s in ((0, 0.1), (1, 0.5), (2, 0.12)):
        for i in range(WINDOW):
            held.take(_done(rank, i + 1, i * 0.1, compute_s=compute_s))
    s = held.summary(5.0)
    assert (s.slow_rank, s.slow_s, s.compute_s) == (1, 0.5, 0.12)


def test_a_summary_vouches_for_step_progress_not_for_a_mark_of_a_rank_waiting():
    held = HeldReports(summary_s=0.0)
    held.take(_done(0, 5, 0.0))
    held.take(_done(1, 5, 0.0))
    held.take(Report(1, 1001, m.Progress(rank=1, attempt=0, step=5, phase="sync", metrics={}), 1.5))  # it waits
    held.take(_done(0, 6, 1.8))
    assert held.summary(2.0).age_s == 2.0  # rank 1 last progressed at 0.0: its mark says it waits, not that it moves
