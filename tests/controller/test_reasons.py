"""Every decision's reason is true: the texts the controller logs and exits with, checked
against the situation that produced them (pure: no processes)."""

from __future__ import annotations

import pytest

from unbroken.config import HangConfig
from unbroken.controller import machine as sm

from tests.conftest import run_machine as run
from unbroken.controller.executor import _committed
from unbroken.controller.watchdog import Watchdog
from unbroken.controller.views import RankView
from unbroken.names import Phase, WorkerState

pytestmark = pytest.mark.timeout(10)


def start(world=4, nnodes=1, ready=True, **kw):
    can_dump = kw.pop("can_dump", False)
    state = sm.JobState(sm.JobPolicy(max_restarts=kw.pop("max_restarts", 3),
                                     allowed=kw.pop("allowed", ("recover-in-place", "recover", "exit")), **kw),
                        world_size=world, nnodes=nnodes, can_dump=can_dump)
    for node in range(nnodes):
        state, _ = sm.transition(state, sm.AgentJoined(node))
    if ready:
        for rank in range(world):
            state, _ = sm.transition(state, sm.SessionReady(rank, 0, 0))
    return state




def finish_reason(actions) -> str:
    (finish,) = [a for a in actions if isinstance(a, sm.Finish)]
    return finish.reason


def test_a_node_lost_without_a_standby_is_not_called_a_spent_restart_budget():
    state = start(world=4, nnodes=2, max_restarts=32767)
    state, actions = run(state, sm.AgentLost(1))
    reason = finish_reason(actions)
    assert "restart budget" not in reason
    assert "the agent of node(s) [1] was lost" in reason and "--standby" in reason


def test_a_node_lost_with_recover_not_allowed_names_the_strategy():
    state = start(world=4, nnodes=2, allowed=("recover-in-place",))
    state, _ = run(state, sm.StandbyJoined(2))
    state, actions = run(state, sm.AgentLost(1))
    assert "rung recover (onto a standby agent) is not in --recover-strategy recover-in-place" \
        in finish_reason(actions)


def test_a_node_lost_with_exit_allowed_restarts_the_job_with_its_ranks_on_the_standby():
    state = start(world=4, nnodes=2, allowed=("recover-in-place", "exit"))
    state, _ = run(state, sm.StandbyJoined(2))
    state, actions = run(state, sm.AgentLost(1))
    (decision,) = [a for a in actions if isinstance(a, sm.Decide)]
    assert decision.rung == "exit"
    assert [state.agent_of(r) for r in range(4)] == [0, 0, 2, 2] and not state.standbys
    state, actions = run(state, sm.AgentStopped(0, 0))
    assert not [a for a in actions if isinstance(a, sm.StartAttempt)]  # the standby has not stopped yet
    state, actions = run(state, sm.AgentStopped(2, 0))
    assert [a.attempt for a in actions if isinstance(a, sm.StartAttempt)] == [1]


def test_a_spent_restart_budget_says_so_with_the_figures():
    state = start(ready=False, max_restarts=1)
    state, _ = run(state, sm.RankExited(1, 0, 1, None), sm.AgentStopped(0, 0))
    state, actions = run(state, sm.RankExited(1, 1, 1, None, step=4))
    assert finish_reason(actions).startswith("restart budget spent (1 of --max-restarts 1 used)")


def test_ranks_that_never_committed_are_not_said_to_lack_a_step_loop():
    state = start(ready=False)
    state, actions = run(state, sm.RankExited(2, 0, None, 9, step=105))
    (decision,) = [a for a in actions if isinstance(a, sm.Decide)]
    assert decision.rung == "exit"
    assert "rank 2 was killed by a signal (signal 9) at step 105" in decision.reason
    assert "ranks [0, 1, 2, 3] have not committed a step through unbroken in this attempt" in decision.reason
    assert "step loop" not in decision.reason


def test_a_rank_that_cannot_recover_in_flight_names_why():
    state = start(ready=False)
    for rank in range(4):
        state, _ = run(state, sm.SessionReady(rank, 0, 0, not_in_flight="it tracks a DistributedDataParallel "
                                                                         "module"))
    state, actions = run(state, sm.RankExited(3, 0, None, 9, step=7))
    (decision,) = [a for a in actions if isinstance(a, sm.Decide)]
    assert decision.rung == "exit"
    assert "rank 0 cannot be recovered in flight: it tracks a DistributedDataParallel module" in decision.reason
    # a new attempt forgets the old attempt's reports
    state, _ = run(state, sm.AgentStopped(0, 0))
    assert state.not_in_flight == () and state.ready == frozenset()


def test_in_flight_tries_used_up_is_the_reason_for_exit():
    state = start(max_recovery_tries=1)
    state, _ = run(state, sm.RankExited(2, 0, None, 9, step=3))
    state, actions = run(state, sm.RankExited(1, 0, None, 9, step=3))
    (decision,) = [a for a in actions if isinstance(a, sm.Decide)]
    assert decision.rung == "exit" and "1 in-flight tries used, at most 1" in decision.reason
    assert "has a live replica" not in decision.reason


def test_a_failure_without_a_reported_step_does_not_claim_it_was_before_the_first_step():
    failure = sm.Failure(rank=1, attempt=0, kind="crash", signal=9)
    assert failure.describe() == "rank 1 was killed by a signal (signal 9) with no step reported, attempt 0"
    assert "at step 120" in sm.Failure(rank=1, attempt=0, kind="exit", exit_code=1, step=120).describe()


def test_the_decision_event_has_no_committed_step_when_none_was_committed():
    assert _committed(-1) is None and _committed(0) == 0 and _committed(105) == 105


def _view(rank: int, started_t: float, *, in_loop: bool = False, phase: str = Phase.STARTING) -> RankView:
    return RankView(rank=rank, attempt=0, started_t=started_t, last_progress_t=started_t, phase=phase,
                      state=WorkerState.RUNNING, in_step_loop=in_loop)


def test_a_job_without_a_step_loop_is_never_suspected_of_hanging():
    monitor = Watchdog(HangConfig(first_step_timeout_s=2.0), 0.0)
    workers = [_view(r, 0.0) for r in range(4)]
    assert monitor.find_hung(workers, 0, now=3 * 2.0 + 1) is None  # a plain torchrun script at 3x the timeout


def test_once_a_rank_entered_the_step_loop_a_rank_that_did_not_is_the_suspect():
    monitor = Watchdog(HangConfig(first_step_timeout_s=2.0), 0.0)
    workers = [_view(0, 0.0, in_loop=True, phase=Phase.SYNC), _view(1, 0.0)]
    workers[0].last_progress_t = 0.5
    hung = monitor.find_hung(workers, 0, now=3.0)
    assert hung is not None and hung[0].rank == 1


def test_a_node_lost_says_the_last_step_its_rank_reported():
    state = start(world=4, nnodes=2, max_restarts=32767)
    state, actions = run(state, sm.AgentLost(1, last_steps=(30, 30, 30, 29)))
    assert "rank 2 was lost with its node's agent at step 30" in finish_reason(actions)
    state = start(world=4, nnodes=2, max_restarts=32767)
    state, actions = run(state, sm.AgentLost(1, last_steps=(30, 30, None, None)))
    assert "rank 2 was lost with its node's agent with no step reported" in finish_reason(actions)
