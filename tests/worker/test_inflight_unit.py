"""The in-flight object's state changes, with a fake controller link and one-rank gloo groups
(no other process): pending -> survive -> regrouped on the next generation -> resumed."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from unbroken.errors import CheckpointError, CollectiveAborted, StateDamaged
from unbroken.faults.inject import FaultInjector
from unbroken.protocol import messages as m
from unbroken.worker.api import SessionHooks
from unbroken.worker.inflight import InFlight
from unbroken.worker.tracked import TrackedState
from unbroken.worker_config import WorkerConfig

pytestmark = pytest.mark.timeout(20)


class FakeControl:
    """The controller link as InFlight sees it: scripted orders, every report recorded."""

    def __init__(self, *orders) -> None:
        self.abort_gen = 0
        self.committed_step = -1  # as the last abort order said
        self.orders = list(orders)
        self.calls: list[tuple] = []

    def wait_regroup(self, timeout_s, on_abort, reported):
        on_abort(reported)
        return self.orders.pop(0) if self.orders else None

    def __getattr__(self, name):  # paused, damaged, joined, resumed, dumped
        # (keyword arguments recorded only when set: paused(..., cut_in_tail=True))
        return lambda *args, **kw: self.calls.append((name, *args, *(f"{k}={v}" for k, v in kw.items() if v)))


class FakeDump:
    def __init__(self) -> None:
        self.written: list = []

    def check_dump(self) -> None:
        pass

    def write_dump(self, step, ranks, states=None) -> None:
        self.written.append((step, ranks))


def make(control, *, replacement=False, dump=None):
    cfg = WorkerConfig(mode="managed", gen=1 if replacement else 0)
    tracked = TrackedState()
    tracked.add("w", torch.arange(4.0), SessionHooks(lambda *a: None, lambda: False, True))
    injector = FaultInjector([], 0, lambda fault: True)
    return InFlight(cfg, device=torch.device("cpu"), control=control, store=dist.HashStore(), group=None,
                    tracked=tracked, injector=injector, dump=dump or FakeDump())


def test_a_noted_fault_makes_a_recovery_pending_and_survive_moves_to_the_next_generation():
    control = FakeControl(m.Regroup(gen=1, resume_step=5, replaced=[]))
    inflight = make(control)
    assert not inflight.pending
    assert inflight.note_fault(5, CollectiveAborted("peer lost"))
    assert inflight.pending and inflight.fault_noted
    assert inflight.survive(5, "sync") == 5
    assert (inflight.gen, inflight.fault_noted, inflight.pause_phase) == (1, False, "sync")
    assert inflight.group is not None and inflight.group.size() == 1
    assert [c[0] for c in control.calls] == ["paused", "paused", "resumed"]
    assert control.calls[0] == ("paused", 0, 5, "sync")
    fields = control.calls[2][4]  # where the restore time went, per sub-phase (with the report)
    assert fields["role"] == "survivor" and fields["gen"] == 1
    assert {"restore_s", "recoverable_s", "exchange_s", "load_s", "realign_s"} <= set(fields)
    assert "script_s" not in fields


@pytest.mark.parametrize("resume, committed", [(6, True), (5, False)], ids=["rolled-forward", "rolled-back"])
def test_a_rank_paused_in_the_commit_vote_learns_the_decision_and_keeps_the_order_for_the_step_end(resume, committed):
    control = FakeControl(m.Regroup(gen=1, resume_step=resume, replaced=[]))
    control.abort_gen = 1
    inflight = make(control)
    assert inflight.pause_in_vote(5) is committed  # True: the update goes on from its own gradients
    assert control.calls[0] == ("paused", 1, 5, "sync")
    assert inflight.survive(resume, "update" if committed else "sync") == resume  # the held order: no second pause
    assert [c[0] for c in control.calls] == ["paused", "paused", "resumed"] and inflight.gen == 1


def test_an_abort_order_that_says_the_step_was_recorded_committed_needs_no_pause():
    control = FakeControl()
    control.abort_gen, control.committed_step = 1, 5
    assert make(control).pause_in_vote(5) is True and control.calls == []


def test_a_held_order_that_a_newer_abort_replaced_is_not_used():
    control = FakeControl(m.Regroup(gen=1, resume_step=6, replaced=[]), m.Regroup(gen=2, resume_step=6, replaced=[]))
    control.abort_gen = 1
    inflight = make(control)
    assert inflight.pause_in_vote(5)
    control.abort_gen = 2  # a second fault while this rank finished update 5
    assert inflight.survive(6, "compute") == 6 and inflight.gen == 2
    assert ("paused", 2, 6, "compute") in control.calls


def test_the_old_group_goes_to_the_graveyard_never_dropped():
    control = FakeControl(m.Regroup(gen=1, resume_step=3, replaced=[]), m.Regroup(gen=2, resume_step=3, replaced=[]))
    inflight = make(control)
    inflight.survive(3, "compute")
    first = inflight.group
    inflight.survive(3, "compute")
    assert inflight.graveyard == [first] and inflight.gen == 2


def test_an_abort_order_is_pending_until_the_generation_moves_past_it():
    control = FakeControl(m.Regroup(gen=1, resume_step=0, replaced=[]))
    inflight = make(control)
    control.abort_gen = 1
    assert inflight.should_abort() and inflight.pending
    inflight.survive(0, "compute")
    assert not inflight.should_abort() and not inflight.pending


def test_damaged_state_is_reported_and_this_rank_needs_state_until_the_transfer():
    control = FakeControl(m.Regroup(gen=1, resume_step=2, replaced=[]))
    inflight = make(control)
    assert inflight.note_fault(2, StateDamaged("bits flipped"))
    assert inflight.damaged is not None
    inflight.survive(2, "update")
    assert control.calls[0] == ("damaged", "bits flipped", "memory-fault")
    assert control.calls[1][0] == "joined"  # announced as needing state while it waits
    assert inflight.damaged is None and not inflight.needs_state


def test_only_collective_failures_under_a_controller_are_recoverable():
    inflight = make(FakeControl())
    noted = RuntimeError("Connection reset by peer")
    noted.add_note("unbroken: during the all-reduce of step 3")
    assert inflight.is_recoverable(noted)
    assert not inflight.is_recoverable(RuntimeError("a bug in the script"))
    assert not inflight.note_fault(0, ValueError("bad")) and not inflight.pending
    assert not make(None).is_recoverable(CollectiveAborted("x"))


def test_a_replacement_joins_at_init_and_receives_its_state_in_join():
    control = FakeControl(m.Regroup(gen=1, resume_step=8, replaced=[]))
    inflight = make(control, replacement=True)
    assert inflight.needs_state
    inflight.await_group()
    assert inflight.gen == 1 and control.calls == [("joined", 0)]
    assert inflight.join() == 8 and not inflight.needs_state
    name, fields = control.calls[-1][0], control.calls[-1][4]
    assert name == "resumed" and fields["role"] == "replacement" and fields["script_s"] >= 0


def test_a_dump_order_is_written_then_the_next_order_is_awaited():
    dump = FakeDump()
    control = FakeControl(m.Dump(gen=1, step=4, assign=[]), m.Regroup(gen=2, resume_step=4, replaced=[]))
    inflight = make(control, dump=dump)
    inflight.survive(4, "compute")
    assert dump.written == [(4, [0])] and ("dumped", 4, [0], "") in control.calls


def test_a_failed_dump_is_reported_not_raised():
    class NoStorage(FakeDump):
        def check_dump(self) -> None:
            raise CheckpointError("no storage tier (--save DIR) to dump to")

    control = FakeControl(m.Dump(gen=1, step=4, assign=[]), m.Regroup(gen=2, resume_step=4, replaced=[]))
    make(control, dump=NoStorage()).survive(4, "compute")
    assert ("dumped", 4, [0], "no storage tier (--save DIR) to dump to") in control.calls
