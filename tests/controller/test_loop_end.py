"""The end of a job (controller/loop_end.py, issue 32 case 3): a rank that hangs after its step loop
is killed and counted as finished; a rank lost before its loop ended, once others have left theirs,
takes the ladder past the in-flight rungs. The machine's part (pure) and the monitor's (no processes)."""

from __future__ import annotations

import pytest

from tests.controller.test_machine import commit, kinds, run, start
from tests.controller.test_server_pieces import FakeHub
from unbroken.controller import machine as sm
from unbroken.controller import hangs
from unbroken.controller.hangs import RankProgress
from unbroken.names import Phase, WorkerState

pytestmark = pytest.mark.timeout(10)


def test_a_rank_hung_after_its_loop_is_killed_once_and_the_job_succeeds_saying_so():
    state, _ = commit(start(world=4), 9)
    state, _ = run(state, *(sm.LoopFinished(r, 0) for r in range(4)),
                   *(sm.RankExited(r, 0, 0, None, step=10) for r in range(3)))  # ranks 0-2 exited 0
    state, actions = run(state, sm.RankHung(3, 0, 10, 3.2))
    assert kinds(actions) == ["KillRank"] and actions[0].rank == 3
    assert "rank 3 hung after its step loop (after step 10) for 3.2 s" in actions[0].reason
    assert state.hung_after_loop == {3} and not state.hung_ranks  # the in-loop hang rule stays free
    assert run(state, sm.RankHung(3, 0, 10, 4.0))[1] == []  # killed already: once
    state, actions = run(state, sm.RankExited(3, 0, None, 9, step=10))
    assert actions[0] == sm.ExitedAfterLoop(3, None, 9, 10, hung=True)
    assert state.phase is sm.JobPhase.SUCCEEDED and actions[-1].exit_code == 0
    reason = actions[-1].reason
    assert "rank 3 hung after its step loop" in reason and "killed at the hang timeout" in reason
    assert not [a for a in actions if isinstance(a, (sm.Decide, sm.StopAttempt, sm.RestartRanks))]


def test_a_hang_after_the_loop_while_others_still_train_waits_for_them():
    state, actions = run(start(world=2), sm.LoopFinished(1, 0), sm.RankHung(1, 0, 10, 6.0),
                         sm.RankExited(1, 0, None, 9, step=10))
    assert kinds(actions) == ["KillRank", "ExitedAfterLoop"] and state.phase is sm.JobPhase.RUNNING
    assert actions[1] == sm.ExitedAfterLoop(1, None, 9, 10, hung=True)  # warned as a hang, not a crash
    state, actions = run(state, sm.LoopFinished(0, 0), sm.RankExited(0, 0, 0, None, step=10))
    assert state.phase is sm.JobPhase.SUCCEEDED and actions == [sm.Finish(0, actions[0].reason)]


def test_a_hang_of_a_rank_still_in_its_loop_is_not_one_after_the_loop():
    state, actions = run(start(world=2), sm.LoopFinished(0, 0), sm.RankHung(1, 0, 7, 6.0))
    assert kinds(actions) == ["KillRank"] and state.hung_ranks == {1} and not state.hung_after_loop
    assert "made no step progress" in actions[0].reason


def test_a_rank_lost_after_the_others_left_their_loops_restarts_the_job():
    """Nobody is left to redo the step with a replacement: no in-flight rung, the job restarts."""
    state, _ = commit(start(world=4), 9)
    state, _ = run(state, *(sm.LoopFinished(r, 0) for r in (0, 1, 3)), sm.RankExited(0, 0, 0, None, step=10))
    state, actions = run(state, sm.RankExited(2, 0, None, 9, step=9))
    assert kinds(actions) == ["Decide", "StopAttempt"] and actions[0].rung == "exit"
    assert "ranks [0, 1, 3] already left their step loops" in actions[0].reason
    assert state.phase is sm.JobPhase.STOPPING and state.recovery is None


def test_the_next_attempt_forgets_the_ranks_hung_after_their_loop():
    state, _ = run(start(world=2, allowed=("exit",)), sm.LoopFinished(1, 0), sm.RankHung(1, 0, 5, 6.0),
                   sm.RankExited(0, 0, 1, None, step=3), sm.AgentStopped(0, 0))
    assert state.attempt == 1 and not state.hung_after_loop and not state.loop_finished


def test_only_a_stopped_or_zombie_process_past_its_timeout_is_hung_after_its_loop():
    assert hangs.hung_after_loop([RankProgress(0, "finished", 100.0, 5.0)]) is None  # running: a long final save
    assert hangs.hung_after_loop([RankProgress(0, "finished", 4.0, 5.0, process="stopped")]) is None
    late = [RankProgress(0, "finished", 6.0, 5.0, process="stopped"), RankProgress(1, "finished", 9.0, 5.0, "zombie")]
    assert hangs.hung_after_loop(late).rank == 1


def _finishing(hub: FakeHub, rank: int, process: str, process_t: float) -> None:
    w = hub.board.view(rank)
    w.state, w.phase, w.in_step_loop, w.steps_in_generation = WorkerState.FINISHING, Phase.FINISHED, True, 5
    w.process, w.process_t = process, process_t


def test_the_monitor_finds_a_rank_stopped_after_its_loop_within_the_hang_timeout():
    hub = FakeHub(world_size=3)
    _finishing(hub, 1, "running", 0.0)
    _finishing(hub, 2, "stopped", 10.0)
    timeout_s = hub.watchdog.steady_timeout_s()
    find = hub.watchdog.find_hung_after_loop
    assert find(hub.board.views(), 0, now=10.0 + timeout_s) is None
    assert find(hub.board.views(), 0, now=10.5 + timeout_s).rank == 2
    assert find(hub.board.views(), 0, now=10.5 + timeout_s, killed={2}) is None  # rank 1 runs: never blamed
    assert find(hub.board.views(), 1, now=10.5 + timeout_s) is None  # another attempt's


def test_a_rank_stopped_before_its_first_step_is_blamed_at_the_steady_timeout_not_the_first_step_one():
    hub = FakeHub(world_size=2)
    for w in hub.board.views():
        w.state, w.last_progress_t = WorkerState.RUNNING, 0.0
    hub.board.view(0).phase, hub.board.view(0).in_step_loop = Phase.COMPUTE, True  # waits in step 0
    hub.board.view(1).process, hub.board.view(1).process_t = "stopped", 20.0  # stopped before its first step
    steady, first = hub.watchdog.steady_timeout_s(), hub.cfg.hang.first_step_timeout_s
    assert steady < first
    assert hub.watchdog.find_hung(hub.board.views(), 0, now=20.0 + steady - 0.1) is None
    blamed, why = hub.watchdog.find_hung(hub.board.views(), 0, now=20.5 + steady)
    assert blamed.rank == 1 and why == "its process is stopped"


def test_before_any_step_loop_only_a_stopped_process_is_suspect_at_the_first_step_timeout():
    hub = FakeHub(world_size=2)
    for w in hub.board.views():
        w.state, w.last_progress_t = WorkerState.RUNNING, 0.0  # a plain script: no step reports
    first = hub.cfg.hang.first_step_timeout_s
    assert hub.watchdog.find_hung(hub.board.views(), 0, now=10 * first) is None  # silence alone: no suspect
    hub.board.view(1).process, hub.board.view(1).process_t = "stopped", 5.0
    assert hub.watchdog.find_hung(hub.board.views(), 0, now=5.0 + first - 0.1) is None
    assert hub.watchdog.find_hung(hub.board.views(), 0, now=5.5 + first)[0].rank == 1


def _views_after_loop(exited: dict[int, float | None], killed_running: tuple[int, ...] = ()):
    from unbroken.controller.views import RankView
    from unbroken.names import WorkerState

    views = []
    for rank, exited_t in exited.items():
        state = WorkerState.FINISHED if exited_t is not None else WorkerState.FINISHING
        views.append(RankView(rank=rank, attempt=0, state=state, exited_t=exited_t))
    return views


def test_a_rank_still_running_long_after_every_other_exited_lingers():
    """Issue 32 case 3, a *running* process: past its loop, still there --exit-timeout-s after the
    others exited (a final save or destroy_process_group stuck): found, the lowest rank first."""
    from unbroken.config import HangConfig
    from unbroken.controller.watchdog import Watchdog

    dog = Watchdog(HangConfig(exit_timeout_s=10.0), straggler_factor=0.0)
    views = _views_after_loop({0: 100.0, 1: None, 2: 103.0, 3: None})
    assert dog.find_lingering_after_loop(views, 0, now=112.0) is None  # 9 s after the last exit
    blamed = dog.find_lingering_after_loop(views, 0, now=113.5)
    assert (blamed.rank, round(blamed.silent_s, 1), blamed.timeout_s) == (1, 10.5, 10.0)
    # once rank 1 is killed, its exit does not restart rank 3's clock
    views[1].exited_t = 114.0
    blamed = dog.find_lingering_after_loop(views, 0, now=114.1, killed=[1])
    assert blamed.rank == 3


def test_nothing_lingers_while_a_rank_still_trains_or_none_exited():
    from unbroken.config import HangConfig
    from unbroken.controller.views import RankView
    from unbroken.controller.watchdog import Watchdog
    from unbroken.names import WorkerState

    dog = Watchdog(HangConfig(exit_timeout_s=10.0), straggler_factor=0.0)
    views = _views_after_loop({0: 100.0, 1: None})
    views.append(RankView(rank=2, attempt=0, state=WorkerState.RUNNING))  # still in its loop
    assert dog.find_lingering_after_loop(views, 0, now=500.0) is None
    assert dog.find_lingering_after_loop(_views_after_loop({0: None, 1: None}), 0, now=500.0) is None
