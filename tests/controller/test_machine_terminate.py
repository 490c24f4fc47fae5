"""The state machine on SIGTERM (controller/terminate.py): a dump of the newest committed step
where one can be made, then exit code 143; never a restart, never a commit of a partial dump."""

from __future__ import annotations

import dataclasses

import pytest

from tests.controller.test_machine import commit, kinds, run, start
from unbroken.controller import machine as sm
from unbroken.controller.terminate import EXIT_TERMINATED
from unbroken.errors import EXIT_FATAL

SIGTERM = sm.TerminateRequested("terminated (SIGTERM) on node 0")


def dumping(**kw):
    """A 4-rank job with --save at step 5 (4 committed), SIGTERM'd, every rank paused: the order sent."""
    state, _ = commit(start(can_dump=True, **kw), 4)
    state, actions = run(state, SIGTERM)
    assert kinds(actions) == ["Terminating", "AbortGeneration"] and actions[0].dump
    assert state.phase is sm.JobPhase.RECOVERING and state.recovery.rung == "dump"
    state, actions = run(state, *(sm.RankPaused(r, 0, 5, "compute") for r in range(4)))
    (order,) = actions
    assert isinstance(order, sm.DumpOrder) and order.step == 5 and order.assign == ()  # every rank writes its own
    return state


def assert_terminated(state, actions, says):
    assert state.phase is sm.JobPhase.TERMINATED
    assert not {"StartAttempt", "RestartRanks", "OrderRegroup", "CommitDump"} & set(kinds(actions))
    finish = actions[-1]
    assert isinstance(finish, sm.Finish) and finish.exit_code == EXIT_TERMINATED == 143
    assert finish.reason.startswith("terminated (SIGTERM) on node 0; stopped without a dump: ")
    assert says in finish.reason


def test_sigterm_dumps_the_newest_committed_step_then_stops_with_143():
    state = dumping()
    state, actions = run(state, *(sm.StepDumped(r, 0, 5, (r,), "") for r in range(3)))
    assert actions == []  # not before every rank's files are written
    state, actions = run(state, sm.StepDumped(3, 0, 5, (3,), ""))
    assert kinds(actions) == ["CommitDump", "StopAttempt", "Finish"] and actions[0].step == 5
    assert actions[-1].exit_code == 143 and "the state at step 5 was dumped to --save" in actions[-1].reason
    assert state.phase is sm.JobPhase.TERMINATED
    # Nothing that comes after (the workers stopped, their exits) restarts the job.
    state, actions = run(state, sm.RankExited(1, 0, None, 15), sm.AgentStopped(0, 0), sm.GraceExpired(20.0))
    assert actions == [] and state.phase is sm.JobPhase.TERMINATED


def test_every_agent_asking_starts_one_dump():
    state = dumping()
    state, actions = run(state, sm.TerminateRequested("terminated (SIGTERM) on node 1"))
    assert actions == [] and state.terminating == SIGTERM.reason


@pytest.mark.parametrize("event, says", [
    (sm.GraceExpired(20.0), "the dump did not finish within 20 s (--sigterm-dump-timeout-s)"),
    (sm.StepDumped(2, 0, 5, (2,), "disk full"), "rank 2 could not dump step 5: disk full"),
    (sm.RankExited(1, 0, None, 9), "rank 1 exited (signal 9) during the dump"),
    (sm.RankHung(3, 0, 5, 30.0), "rank 3 hung during the dump"),
    (sm.AgentLost(0), "node 0 was lost with its agent during the dump"),
    (sm.RecoveryTimeout(0, 1), "passed its deadline (--recovery-timeout-s)"),
])
def test_a_dump_that_cannot_finish_stops_the_job_without_committing_it(event, says):
    state = dumping()
    state, actions = run(state, sm.StepDumped(0, 0, 5, (0,), ""), event)
    assert_terminated(state, actions, says)
    state, actions = run(state, *(sm.StepDumped(r, 0, 5, (r,), "") for r in range(1, 4)))
    assert actions == []  # a late writer commits nothing


@pytest.mark.parametrize("kw, says", [
    ({"can_dump": False}, "no --save DIR to dump to"),
    ({"can_dump": True, "ready": False}, "do not commit their steps through unbroken"),
])
def test_sigterm_without_a_dump_stops_at_once_and_says_why(kw, says):
    state = start(can_dump=kw["can_dump"])
    if kw.get("ready") is False:
        state = dataclasses.replace(state, ready=frozenset({0, 1}))
    state, actions = run(state, SIGTERM)
    assert kinds(actions) == ["Terminating", "StopAttempt", "Finish"] and not actions[0].dump
    assert_terminated(state, actions, says)


def test_sigterm_between_attempts_stops_at_once():
    state, _ = commit(start(can_dump=True, allowed=("exit",)), 4)
    state, _ = run(state, sm.RankExited(1, 0, 1, None))
    assert state.phase is sm.JobPhase.STOPPING
    state, actions = run(state, SIGTERM, sm.AgentStopped(0, 0))
    assert_terminated(state, actions, "the job was stopping")


def test_sigterm_during_a_sub_health_dump_stops_after_it_instead_of_restarting():
    state, _ = commit(start(can_dump=True, sub_health_policy="grace-exit"), 4)
    state, _ = run(state, sm.RankDegraded(2, 0, "slow", step=5),
                   *(sm.RankPaused(r, 0, 5, "compute") for r in range(4)))
    state, actions = run(state, SIGTERM)
    assert kinds(actions) == ["Terminating"] and actions[0].dump
    state, actions = run(state, *(sm.StepDumped(r, 0, 5, (r,), "") for r in range(4)))
    assert kinds(actions) == ["CommitDump", "StopAttempt", "Finish"] and actions[-1].exit_code == 143


def test_ranks_that_finish_during_the_grace_period_end_the_job_with_0():
    state, _ = commit(start(can_dump=True), 4)
    state, _ = run(state, sm.RankExited(0, 0, 0, None))
    state, actions = run(state, SIGTERM)
    assert kinds(actions) == ["Terminating"] and not actions[0].dump  # no dump: rank 0 left its loop
    state, actions = run(state, *(sm.RankExited(r, 0, 0, None) for r in (1, 2, 3)))
    assert actions[-1] == sm.Finish(0, "all 4 ranks finished (after terminated (SIGTERM) on node 0)")


def test_exit_fatal_during_the_dump_still_fails_the_job_with_97():
    state = dumping()
    state, actions = run(state, sm.RankExited(1, 0, EXIT_FATAL, None))
    assert state.phase is sm.JobPhase.FAILED and actions[-1].exit_code == EXIT_FATAL


def test_a_spare_agent_leaving_does_not_stop_the_dump():
    state = dumping()
    state, _ = run(state, sm.StandbyJoined(7))
    state, actions = run(state, sm.AgentLost(7))
    assert actions == [] and state.phase is sm.JobPhase.RECOVERING
