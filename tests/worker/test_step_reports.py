"""What a rank's step reports put on the wire (worker/progress.py): two messages per step when
its phases are short, in-step marks only when a rank stays in them, and an order in which a late
mark never overtakes the report that supersedes it. A recording send, no sockets."""

from __future__ import annotations

import threading
import time

import pytest

from unbroken.names import Phase
from unbroken.protocol import messages as m
from unbroken.worker.progress import StepReports

pytestmark = pytest.mark.timeout(10)

DELAY_S = 0.1


def _reports() -> tuple[StepReports, list]:
    wire: list = []
    return StepReports(lambda msg: wire.append(msg) or True, rank=3, attempt=1, delay_s=DELAY_S), wire


def _one_step(reports: StepReports, step: int) -> None:
    reports.phase(step, Phase.COMPUTE, state=b"own")
    reports.phase(step, Phase.SYNC)
    reports.send_now(m.StepSynced(rank=3, attempt=1, gen=0, step=step))
    reports.phase(step, Phase.UPDATE)
    reports.done(step + 1, {"loss": 1.0})


def test_a_short_step_costs_two_messages_and_its_done_rides_on_the_next_compute_report():
    reports, wire = _reports()
    for step in range(3):
        _one_step(reports, step)
    reports.flush_due()  # nothing stood long enough
    assert [type(x).__name__ for x in wire] == ["Progress", "StepSynced"] * 3
    second = wire[2]
    assert (second.step, second.phase, second.done, second.state, second.metrics["loss"]) == (1, Phase.COMPUTE,
                                                                                              True, b"own", 1.0)
    assert not wire[0].done and wire[0].metrics == {}  # the first step has no step before it
    assert second.metrics["compute_s"] >= 0  # measured by the rank: no 'sync' report needed for it


def test_a_rank_that_stays_in_a_phase_reports_it_after_the_delay():
    reports, wire = _reports()
    reports.phase(4, Phase.COMPUTE)
    reports.phase(4, Phase.SYNC)  # e.g. blocked in the all-reduce
    t = time.monotonic()
    reports.flush_due(t + DELAY_S / 2)
    assert len(wire) == 1
    reports.flush_due(t + DELAY_S * 2)
    assert (wire[-1].step, wire[-1].phase) == (4, Phase.SYNC)
    reports.flush_due(t + DELAY_S * 4)
    assert len(wire) == 2  # sent once


def test_a_rank_blocked_in_a_broadcast_of_its_compute_is_marked_waiting_in_a_collective():
    """DDP's buffer broadcast as the forward begins: a rank blocked there is waiting in a collective (the
    hang rule then blames a peer that never reached it); one that left it before the delay is not."""
    class Work:
        def __init__(self, completed):
            self.completed = completed

        def is_completed(self):
            return self.completed

    reports, wire = _reports()
    reports.phase(4, Phase.COMPUTE)
    reports.collective(4, Work(completed=True))  # left at once
    reports.flush_due(time.monotonic() + DELAY_S * 2)
    assert len(wire) == 1
    reports.collective(4, Work(completed=False))  # blocked
    reports.flush_due(time.monotonic() + DELAY_S * 2)
    assert (wire[-1].step, wire[-1].phase) == (4, Phase.COLLECTIVE)
    reports.phase(4, Phase.SYNC)
    reports.collective(4, Work(completed=False))  # a gather inside the reduction phase: the sync mark stays
    reports.flush_due(time.monotonic() + DELAY_S * 2)
    assert (wire[-1].step, wire[-1].phase) == (4, Phase.SYNC)


def test_a_completed_step_with_no_next_step_is_flushed_before_anything_else_goes_out():
    reports, wire = _reports()
    reports.phase(0, Phase.COMPUTE)
    reports.done(1, {})
    reports.phase(1, Phase.FINISHED)  # the loop ended: done first, then finished
    assert [(x.phase, x.step) for x in wire[1:]] == [(Phase.DONE, 1), (Phase.FINISHED, 1)]
    reports.done(2, {})
    reports.send_now(m.RankPaused(rank=3, attempt=1, gen=1, step=2, phase="compute"))  # a recovery: done first
    assert [type(x).__name__ for x in wire[3:]] == ["Progress", "RankPaused"] and wire[3].phase == Phase.DONE
    reports.done(3, {})
    reports.flush_due(time.monotonic() + DELAY_S * 2)  # the safety net: sent alone after the delay
    assert (wire[-1].phase, wire[-1].step) == (Phase.DONE, 3)


def test_a_mark_due_while_its_step_moves_on_never_lands_after_the_report_that_supersedes_it():
    """The heartbeat thread flushing marks races the training thread's StepSynced: on the wire a
    'sync' mark may come before StepSynced, never after (the controller would put a rank that is
    in its update back in sync)."""
    wire: list = []
    gate = threading.Event()

    def send(msg):
        if isinstance(msg, m.Progress) and msg.phase == Phase.SYNC:
            gate.wait(5)  # the flusher is slow to send the mark it took
        wire.append(msg)
        return True

    reports = StepReports(send, rank=0, attempt=0, delay_s=0.0)
    reports.phase(0, Phase.COMPUTE)
    reports.phase(0, Phase.SYNC)
    flusher = threading.Thread(target=reports.flush_due)
    flusher.start()
    synced = threading.Thread(target=reports.send_now, args=(m.StepSynced(rank=0, attempt=0, gen=0, step=0),))
    synced.start()
    gate.set()
    flusher.join(5)
    synced.join(5)
    kinds = [(type(x).__name__, getattr(x, "phase", "")) for x in wire]
    assert kinds[-1] == ("StepSynced", "")


def test_a_step_committed_without_its_commit_report_costs_one_message_and_says_so_with_its_done():
    """A vote-less step whose state after compute is in node memory (worker/commit.py): no StepSynced;
    its done, on the next compute report or alone after the delay, carries ``synced``."""
    reports, wire = _reports()
    for step in range(2):
        reports.phase(step, Phase.COMPUTE, state=b"own", moved=step == 1)
        reports.phase(step, Phase.SYNC)
        reports.phase(step, Phase.UPDATE)
        reports.done(step + 1, {"loss": 1.0}, synced=True)
    assert [(type(x).__name__, x.step, x.done, x.synced, x.moved) for x in wire] == \
        [("Progress", 0, False, False, False), ("Progress", 1, True, True, True)]
    time.sleep(DELAY_S * 1.5)
    reports.flush_due()  # the last step's done, alone
    assert (wire[-1].phase, wire[-1].step, wire[-1].synced) == (Phase.DONE, 2, True)


def test_a_state_sent_beside_the_phases_keeps_the_reduction_mark_pending():
    """A vote-less step on a node with no file of its state sends it as the reduction begins (SyncState):
    the rank is still marked waiting in the reduction if it stays there, and the state left first."""
    reports, wire = _reports()
    reports.phase(4, Phase.COMPUTE)
    reports.phase(4, Phase.SYNC)
    reports.send_beside(m.SyncState(rank=3, attempt=1, gen=0, step=4, state=b"after-compute"))
    reports.flush_due(time.monotonic() + DELAY_S * 2)
    assert [(type(x).__name__, getattr(x, "phase", None)) for x in wire] == [
        ("Progress", Phase.COMPUTE), ("SyncState", None), ("Progress", Phase.SYNC)]
