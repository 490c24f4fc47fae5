"""The controller's state machine, as a pure function: decisions without processes."""

from __future__ import annotations

import dataclasses

from unbroken.controller import machine as sm

from tests.conftest import run_machine as run
from unbroken.errors import EXIT_FATAL


def start(world=4, nnodes=1, max_restarts=3, allowed=("recover-in-place", "recover", "exit"), replicas=0,
          can_dump=False, **kw):
    state = sm.JobState(sm.JobPolicy(max_restarts=max_restarts, allowed=allowed, **kw), world_size=world, nnodes=nnodes,
                        can_dump=can_dump)
    for node in range(nnodes):
        state, actions = sm.transition(state, sm.AgentJoined(node))
    assert actions == [sm.StartAttempt(0)]
    for rank in range(world):  # every rank runs a step loop that commits
        state, _ = sm.transition(state, sm.SessionReady(rank, 0, replicas))
    return state




def kinds(actions):
    return [type(a).__name__ for a in actions]


def commit(state, step):
    return run(state, *(sm.StepSynced(r, state.attempt, state.gen, step) for r in range(state.world_size)))


def test_a_step_commits_only_when_every_rank_reported_its_reduction():
    state = start()
    state, actions = run(state, *(sm.StepSynced(r, 0, 0, 5) for r in range(3)))
    assert actions == [] and state.committed_step == -1
    state, actions = run(state, sm.StepSynced(3, 0, 0, 5))
    assert actions == [sm.CommitStep(0, 5)] and state.committed_step == 5


def test_ranks_synced_at_once_is_the_same_as_one_step_synced_each():
    """A node's relayed batch (RanksSynced) must leave the state a StepSynced per rank leaves."""
    import random
    rnd, commits = random.Random(7), 0
    for _ in range(50):
        state = start(world=8)
        step, gen = rnd.choice([(5, 0), (5, 1), (-1, 0)])  # committable; another generation's; committed already
        batches = [sorted(rnd.sample(range(8), rnd.randint(1, 8))) for _ in range(rnd.randint(1, 4))]
        one_by_one, folded = state, state
        for ranks in batches:
            one_by_one, a1 = run(one_by_one, *(sm.StepSynced(r, 0, gen, step) for r in ranks))
            folded, a2 = run(folded, sm.RanksSynced(sm.RankSet(ranks), 0, gen, step))
            assert (folded, a2) == (one_by_one, a1)
            commits += len(a1)
    assert commits > 5  # some batches completed a step

def test_dead_rank_the_only_one_synced_means_roll_back():
    state, _ = commit(start(), 4)
    state, _ = run(state, sm.StepSynced(2, 0, 0, 5))  # only rank 2 finished the reduction of step 5
    state, actions = run(state, sm.RankExited(2, 0, None, 9, step=5))
    assert kinds(actions) == ["Decide", "AbortGeneration", "RestartRanks"]
    assert actions[0].rung == "recover-in-place" and actions[2] == sm.RestartRanks(frozenset({2}), 1, 0)
    state, actions = run(state, *(sm.RankPaused(r, 0, 5, "sync") for r in (0, 1, 3)),
                         sm.ReplacementJoined(2, 0, 1))
    (regroup,) = actions
    assert (regroup.gen, regroup.resume_step, regroup.replaced) == (1, 5, frozenset({2}))
    assert regroup.direction == "roll-back"
    state, actions = run(state, *(sm.RankResumed(r, 0, 1) for r in range(4)))
    assert actions == [sm.Recovered(1, 5, frozenset({2}))]
    assert state.phase is sm.JobPhase.RUNNING and state.gen == 1


def test_crash_after_commit_rolls_forward():
    state, _ = commit(start(), 5)
    state, _ = run(state, sm.RankExited(1, 0, None, 9, step=5))
    state, actions = run(state, sm.RankPaused(0, 0, 5, "update"), sm.RankPaused(2, 0, 6, "sync"),
                         sm.RankPaused(3, 0, 6, "compute"), sm.ReplacementJoined(1, 0, 1))
    assert actions[0].resume_step == 6


def test_a_second_fault_during_recovery_starts_the_next_generation():
    state = start()
    state, _ = run(state, sm.RankExited(2, 0, None, 9), sm.RankPaused(0, 0, 0, "sync"))
    state, actions = run(state, sm.RankExited(0, 0, None, 9))  # a source dies while recovering
    assert kinds(actions) == ["Decide", "AbortGeneration", "RestartRanks"]
    assert state.recovery.gen == 2 and state.recovery.replaced == {0, 2} and state.recovery.paused == frozenset()
    state, actions = run(state, sm.RankPaused(1, 0, 0, "sync"), sm.RankPaused(3, 0, 0, "sync"),
                         sm.ReplacementJoined(2, 0, 2), sm.ReplacementJoined(0, 0, 2))
    assert kinds(actions) == ["OrderRegroup"] and actions[0].gen == 2


def test_no_live_replica_falls_to_exit_and_restarts_the_job():
    state = start(replicas=2)  # N = 2 over 4 ranks: shard 0 on ranks {0, 2}
    state, _ = run(state, sm.RankExited(0, 0, None, 9))
    state, actions = run(state, sm.RankExited(2, 0, None, 9))
    assert kinds(actions) == ["Decide", "StopAttempt"] and actions[0].rung == "exit"
    assert "no live replica of optimizer shard 0" in actions[0].reason
    state, actions = run(state, sm.AgentStopped(0, 0))
    assert actions == [sm.StartAttempt(1)] and state.restarts_used == 1 and state.ready == frozenset()


def test_two_ranks_in_different_blocks_are_replaced_in_flight():
    state = start(replicas=2)
    state, _ = run(state, sm.RankExited(0, 0, None, 9))
    state, actions = run(state, sm.RankExited(3, 0, None, 9))
    assert actions[0].rung == "recover-in-place" and state.recovery.replaced == {0, 3}


def test_without_a_step_loop_everywhere_only_exit_is_feasible():
    state = sm.JobState(sm.JobPolicy(max_restarts=1, allowed=("recover-in-place", "exit")), world_size=2)
    state, _ = run(state, sm.AgentJoined(0), sm.SessionReady(0, 0, 0))
    state, actions = run(state, sm.RankExited(1, 0, 1, None))
    assert actions[0].rung == "exit" and "have not committed a step through unbroken" in actions[0].reason


def test_no_replica_restore_forbids_in_flight():
    state = start(replicas_allowed=False)
    state, actions = run(state, sm.RankExited(1, 0, None, 9))
    assert actions[0].rung == "exit" and "--no-replica-restore" in actions[0].reason


def test_recover_moves_the_rank_to_a_standby_agent():
    state = start(allowed=("recover", "exit"))
    state, _ = run(state, sm.StandbyJoined(1))
    state, actions = run(state, sm.RankExited(2, 0, None, 9))
    assert actions[0].rung == "recover" and actions[2] == sm.RestartRanks(frozenset({2}), 1, 1)
    assert state.agent_of(2) == 1 and state.standbys == frozenset()


def test_a_lost_node_recovers_onto_a_standby_or_fails():
    state = start(world=4, nnodes=2)
    state, actions = run(state, sm.AgentLost(1))
    assert kinds(actions)[-1] == "Finish" and actions[-1].exit_code == 1  # no spare: nothing can host 2, 3
    state = start(world=4, nnodes=2)
    state, _ = run(state, sm.StandbyJoined(2))
    state, actions = run(state, sm.AgentLost(1))
    assert actions[0].rung == "recover" and actions[2] == sm.RestartRanks(frozenset({2, 3}), 1, 2)


def test_a_split_vote_rolls_forward_past_the_record_and_says_so():
    """Rank 1 died inside the commit vote of step 5, before the controller had every StepSynced of 5:
    rank 0 passed the vote (it updates), rank 2 is paused in it: step 5 commits, all resume at 6."""
    state, _ = commit(start(), 4)
    state, _ = run(state, sm.RankExited(1, 0, None, 9, step=5))
    state, actions = run(state, sm.RankPaused(0, 0, 5, "update"), sm.RankPaused(2, 0, 5, "sync"),
                         sm.RankPaused(3, 0, 6, "compute"), sm.ReplacementJoined(1, 0, 1))
    (regroup,) = actions
    assert (regroup.resume_step, regroup.voted, state.committed_step) == (6, True, 5)
    state, actions = run(state, *(sm.RankResumed(r, 0, 1) for r in range(4)))
    assert actions == [sm.Recovered(1, 6, frozenset({1}))]


def test_a_survivor_cut_inside_a_reduction_a_peer_completed_is_behind():
    """A step committed without a vote (worker/commit.py): rank 1 died as it began its update of 5;
    rank 0 made the update (it is in step 6), rank 2 was cut inside the reduction of 5 (its gradients
    not whole): step 5 committed, rank 2 takes the update from a peer; rank 3, cut inside the
    reduction of 6 (not committed), rolls back as any survivor does."""
    state, _ = commit(start(), 4)
    state, _ = run(state, sm.RankExited(1, 0, None, 9, step=5))
    state, actions = run(state, sm.RankPaused(0, 0, 6, "sync", cut=""), sm.RankPaused(2, 0, 5, "sync", cut=""),
                         sm.RankPaused(3, 0, 6, "sync", cut=""), sm.ReplacementJoined(1, 0, 1))
    (regroup,) = actions
    assert (regroup.resume_step, regroup.behind, regroup.replaced) == (6, frozenset({2}), frozenset({1}))
    state, actions = run(state, *(sm.RankResumed(r, 0, 1) for r in range(4)))
    assert actions == [sm.Recovered(1, 6, frozenset({1}))]


def test_a_later_pause_of_a_survivor_replaces_its_cut():
    state, _ = commit(start(), 4)
    state, _ = run(state, sm.RankExited(1, 0, None, 9, step=5))
    state, actions = run(state, sm.RankPaused(2, 0, 5, "sync", cut=""), sm.RankPaused(2, 0, 5, "update"),
                         sm.RankPaused(0, 0, 6, "compute"), sm.RankPaused(3, 0, 6, "compute"),
                         sm.ReplacementJoined(1, 0, 1))
    assert actions[0].behind == frozenset()


def test_a_survivor_behind_whose_state_at_the_cut_is_unsure_is_refused():
    state, _ = commit(start(), 4)
    state, _ = run(state, sm.RankExited(1, 0, None, 9, step=5))
    state, actions = run(state, sm.RankPaused(0, 0, 5, "update"), sm.RankPaused(2, 0, 5, "sync", cut="a draw"),
                         sm.RankPaused(3, 0, 5, "done"), sm.ReplacementJoined(1, 0, 1))
    assert kinds(actions) == ["Decide", "Decide", "StopAttempt"]  # the job restarts from its snapshot
    assert "rank 2 was cut inside the reduction of step 5" in actions[0].reason and "a draw" in actions[0].reason
    # not committed (nobody passed 5): a cut with an unsure state just rolls back
    state, _ = commit(start(), 4)
    state, _ = run(state, sm.RankExited(1, 0, None, 9, step=5))
    state, (regroup,) = run(state, sm.RankPaused(0, 0, 5, "sync", cut="a draw"), sm.RankPaused(2, 0, 5, "sync", cut=""),
                            sm.RankPaused(3, 0, 5, "compute"), sm.ReplacementJoined(1, 0, 1))
    assert (regroup.resume_step, regroup.behind, regroup.direction) == (5, frozenset(), "roll-back")


def test_a_recorded_commit_rolls_forward_without_a_vote_seen():
    state, _ = commit(start(), 5)
    state, _ = run(state, sm.RankExited(1, 0, None, 9, step=5))
    state, actions = run(state, *(sm.RankPaused(r, 0, 5, "sync") for r in (0, 2, 3)), sm.ReplacementJoined(1, 0, 1))
    assert (actions[0].resume_step, actions[0].voted) == (6, False)  # they were all in the vote of 5


def test_a_refused_regroup_goes_on_down_the_ladder():
    """The executor refuses a voted roll forward whose replaced rank's own state never arrived."""
    state, _ = commit(start(), 4)
    state, _ = run(state, sm.RankExited(1, 0, None, 9, step=5))
    state, (regroup,) = run(state, sm.RankPaused(0, 0, 5, "update"), sm.RankPaused(2, 0, 5, "sync"),
                            sm.RankPaused(3, 0, 5, "sync"), sm.ReplacementJoined(1, 0, 1))
    state, actions = run(state, sm.RegroupRefused(regroup.gen, "no state"))
    assert kinds(actions) == ["Decide", "Decide", "StopAttempt"] and actions[0].reason == "no state"
    assert actions[1].rung == "exit" and state.phase is sm.JobPhase.STOPPING  # the job restarts from its snapshot
    assert actions[1].failure.kind == "recovery-refused"  # the reason, not "not recovered in time"
    assert "could not be recovered exactly" in actions[1].failure.describe()
    assert run(state, sm.RegroupRefused(regroup.gen - 1, "old"))[1] == []  # an older generation's: nothing


def test_recovery_timeout_falls_to_exit():
    state = start()
    state, _ = run(state, sm.RankExited(2, 0, None, 9))
    state, actions = run(state, sm.RecoveryTimeout(0, 1))
    assert actions[0].rung == "exit" and state.phase is sm.JobPhase.STOPPING


def test_hang_kills_one_rank_at_a_time():
    state = start()
    state, actions = run(state, sm.RankHung(1, 0, 7, 6.0), sm.RankHung(2, 0, 7, 6.0))
    assert actions == [sm.KillRank(1, "rank 1 made no step progress for 6.0 s")]
    state, actions = run(state, sm.RankExited(1, 0, None, 9, step=7))
    assert actions[0].failure.kind == "hang"


def test_restart_budget_spent_reports_the_first_failure():
    state = start(allowed=("exit",), max_restarts=1)
    state, _ = run(state, sm.RankExited(3, 0, 2, None, step=4), sm.AgentStopped(0, 0))
    state, actions = run(state, sm.RankExited(1, 1, None, 9, step=1))
    assert actions[-1] == sm.Finish(1, "restart budget spent (1 of --max-restarts 1 used); root cause: "
                                       "rank 3 exited (exit code 2) at step 4, attempt 0")
    assert state.phase is sm.JobPhase.FAILED


def test_events_of_an_older_attempt_are_ignored():
    state = start(allowed=("exit",))
    state, _ = run(state, sm.RankExited(0, 0, 1, None), sm.AgentStopped(0, 0))
    before = dataclasses.replace(state)
    state, actions = run(state, sm.RankExited(2, 0, 1, None), sm.StepSynced(1, 0, 0, 3))
    assert actions == [] and state == before


def test_all_ranks_finishing_ends_the_job():
    state = start(world=2)
    state, actions = run(state, sm.RankExited(0, 0, 0, None), sm.RankExited(1, 0, 0, None))
    assert actions == [sm.Finish(0, "all 2 ranks finished")]


def test_a_fatal_exit_fails_the_job_at_once_without_a_restart():
    state = start(max_restarts=5)
    state, actions = run(state, sm.RankExited(1, 0, EXIT_FATAL, None, last_lines=(
        "loading data", "unbroken: rank 1: fatal error: ShmCapacityError: does not fit in /dev/shm")))
    assert state.phase is sm.JobPhase.FAILED and state.restarts_used == 0 and state.recovery is None
    assert kinds(actions) == ["Decide", "StopAttempt", "Finish"]
    assert actions[0].rung == sm.GIVE_UP and actions[0].failure.kind == "fatal"
    (finish,) = [a for a in actions if isinstance(a, sm.Finish)]
    assert finish.exit_code == EXIT_FATAL  # `unbroken run` exits 97 too: the cluster manager must not restart it
    assert finish.reason.startswith(f"rank 1 exited with EXIT_FATAL ({EXIT_FATAL}: fatal error, not restarted): "
                                    "loading data | unbroken: rank 1: fatal error: ShmCapacityError")
    assert "root cause: rank 1 exited with a fatal error (EXIT_FATAL: not restarted) (exit code 97) with no " \
           "step reported, attempt 0" in finish.reason
    # The others exiting afterwards (stopped) changes nothing: no new attempt starts.
    state, actions = run(state, sm.RankExited(0, 0, None, 15), sm.AgentStopped(0, 0))
    assert actions == [] and state.phase is sm.JobPhase.FAILED


def test_a_fatal_exit_during_an_in_flight_recovery_ends_it():
    state = start()
    state, _ = run(state, sm.RankExited(2, 0, None, 9))
    assert state.phase is sm.JobPhase.RECOVERING
    state, actions = run(state, sm.RankExited(0, 0, EXIT_FATAL, None, step=3))
    assert state.phase is sm.JobPhase.FAILED and state.recovery is None
    assert not {"StartAttempt", "RestartRanks", "AbortGeneration", "OrderRegroup"} & set(kinds(actions))
    assert actions[-1].exit_code == EXIT_FATAL
    assert actions[-1].reason.startswith(f"rank 0 exited with EXIT_FATAL ({EXIT_FATAL}: fatal error, not "
                                         "restarted): no output; root cause: rank 2 was killed by a signal")


def test_an_exit_code_other_than_exit_fatal_still_restarts():
    state = start(allowed=("exit",))
    _, actions = run(state, sm.RankExited(1, 0, EXIT_FATAL - 1, None))
    assert kinds(actions) == ["Decide", "StopAttempt"] and actions[0].rung == "exit"


def test_a_rank_killed_after_it_finished_its_loop_is_a_warning_and_the_job_succeeds():
    state = start(world=2)
    state, actions = run(state, sm.LoopFinished(1, 0), sm.RankExited(1, 0, None, 9, step=20))
    assert actions == [sm.ExitedAfterLoop(1, None, 9, 20)]  # no decision, no recovery, no restart
    assert state.phase is sm.JobPhase.RUNNING and state.recovery is None and state.restarts_used == 0
    state, actions = run(state, sm.LoopFinished(0, 0), sm.RankExited(0, 0, 0, None, step=20))
    assert state.phase is sm.JobPhase.SUCCEEDED
    assert actions == [sm.Finish(0, "all 2 ranks finished their loops (ranks [1] exited abnormally afterwards: "
                                    "see the 'exited_after_loop' events)")]


def test_a_crash_at_interpreter_exit_after_the_loop_is_a_warning_too():
    state = start(world=2)
    state, actions = run(state, sm.LoopFinished(0, 0), sm.LoopFinished(1, 0), sm.RankExited(0, 0, 0, None),
                         sm.RankExited(1, 0, 134, None, step=8))
    assert kinds(actions) == ["ExitedAfterLoop", "Finish"] and actions[-1].exit_code == 0


def test_a_rank_that_dies_before_finishing_its_loop_still_recovers():
    state = start(world=2)
    state, actions = run(state, sm.LoopFinished(0, 0), sm.RankExited(1, 0, None, 9, step=19))
    # by the ladder; rank 0 left its loop, so nobody can redo the step in flight: a job restart (loop_end.py)
    assert kinds(actions)[0] == "Decide" and actions[0].rung == "exit" and state.phase is sm.JobPhase.STOPPING
    assert "ExitedAfterLoop" not in kinds(actions)


def test_a_loop_finished_in_an_older_attempt_does_not_count():
    state = start(world=2, allowed=("exit",))
    state, _ = run(state, sm.LoopFinished(1, 0), sm.RankExited(0, 0, 1, None), sm.AgentStopped(0, 0))
    assert state.attempt == 1 and not state.loop_finished
    state, actions = run(state, sm.LoopFinished(1, 0), sm.RankExited(1, 1, None, 9))  # attempt 0's report: stale
    assert kinds(actions)[0] == "Decide" and "ExitedAfterLoop" not in kinds(actions)
