"""Blaming a hang on the rank that is not progressing (issue 11, item 3): pure logic."""

from __future__ import annotations

from tests.controller.test_machine import commit, kinds, run, start
from unbroken.controller import machine as sm
from unbroken.controller.hangs import RankProgress, blame_hang, silent_in_recovery, why


def test_peers_waiting_in_sync_past_the_timeout_do_not_take_the_blame():
    # rank 1 stopped in compute; 0, 2 and 3 entered sync before it and crossed the timeout first
    ranks = [RankProgress(0, "sync", 5.3, 5.0), RankProgress(1, "compute", 4.9, 5.0),
             RankProgress(2, "sync", 5.6, 5.0), RankProgress(3, "sync", 5.5, 5.0)]
    blamed = blame_hang(ranks)
    assert blamed.rank == 1
    assert why(blamed, ranks) == "it never reached the collective (phase compute) while ranks [0, 2, 3] wait in sync"


def test_a_stopped_process_is_blamed_first_even_inside_the_collective():
    ranks = [RankProgress(0, "sync", 6.0, 5.0), RankProgress(1, "sync", 5.2, 5.0, process="stopped"),
             RankProgress(2, "compute", 5.1, 5.0)]
    blamed = blame_hang(ranks)
    assert blamed.rank == 1 and why(blamed, ranks) == "its process is stopped"
    zombie = [RankProgress(0, "compute", 6.0, 5.0), RankProgress(3, "sync", 1.0, 5.0, process="zombie")]
    assert blame_hang(zombie).rank == 3


def test_no_rank_past_its_timeout_is_no_hang_and_ties_go_to_the_longest_silent():
    assert blame_hang([RankProgress(0, "compute", 4.0, 5.0, process="stopped"), RankProgress(1, "sync", 1, 5)]) is None
    assert blame_hang([]) is None
    assert blame_hang([RankProgress(0, "sync", 5.5, 5.0), RankProgress(1, "sync", 7.0, 5.0)]).rank == 1


def test_a_survivor_that_does_not_answer_the_abort_within_its_timeout_is_hung():
    ranks = [RankProgress(0, "sync", 6.0, 5.0), RankProgress(1, "compute", 6.0, 5.0, process="stopped"),
             RankProgress(3, "sync", 6.0, 5.0)]
    assert silent_in_recovery(ranks, answered={0, 3}).rank == 1
    assert silent_in_recovery(ranks, answered={0, 1, 3}) is None
    early = [RankProgress(1, "compute", 2.0, 5.0, process="stopped")]
    assert silent_in_recovery(early, answered=set()) is None  # still within its hang timeout


def test_the_machine_kills_a_survivor_silent_during_a_recovery():
    state, _ = commit(start(), 3)
    state, actions = run(state, sm.RankExited(2, 0, None, 9, step=4))
    assert actions[0].rung == "recover-in-place"
    state, _ = run(state, sm.RankPaused(0, 0, 4, "sync"), sm.RankPaused(3, 0, 4, "sync"))
    state, actions = run(state, sm.RankHung(1, 0, 3, 5.5))  # rank 1 never paused
    assert actions == [sm.KillRank(1, "rank 1 did not answer the abort of generation 1 for 5.5 s")]
    state, actions = run(state, sm.RankExited(1, 0, None, 9, step=4))
    assert actions[0].rung == "recover-in-place" and "AbortGeneration" in kinds(actions)
    assert state.recovery.replaced == frozenset({1, 2})


def test_during_a_recovery_a_paused_or_replaced_rank_is_not_hung():
    state, _ = commit(start(), 3)
    state, _ = run(state, sm.RankExited(2, 0, None, 9, step=4), sm.RankPaused(0, 0, 4, "sync"))
    assert run(state, sm.RankHung(0, 0, 3, 9.0))[1] == []
    assert run(state, sm.RankHung(2, 0, 3, 9.0))[1] == []


def test_a_rank_that_reported_its_reduction_but_never_joined_the_vote_is_behind_the_voters():
    # rank 2 hung after its reduction of step 7, before the commit vote: the others joined the vote
    ranks = [RankProgress(0, "vote", 5.4, 5.0, step=7), RankProgress(1, "vote", 5.3, 5.0, step=7),
             RankProgress(2, "sync", 5.0, 5.0, step=7), RankProgress(3, "vote", 5.5, 5.0, step=7)]
    blamed = blame_hang(ranks)
    assert blamed.rank == 2
    assert why(blamed, ranks) == ("it never reached the collective (phase sync of step 7) while ranks [0, 1, 3] "
                                  "wait in vote of step 7")


def test_a_rank_stuck_in_a_vote_the_others_passed_is_behind_them():
    # rank 1 joined the vote of step 7 and hung there; the vote passed on the others, which now wait
    # in step 8's reduction: the rank still "in a collective" is the one behind
    ranks = [RankProgress(0, "sync", 5.2, 5.0, step=8), RankProgress(1, "vote", 5.9, 5.0, step=7),
             RankProgress(2, "sync", 5.3, 5.0, step=8), RankProgress(3, "sync", 5.1, 5.0, step=8)]
    assert blame_hang(ranks).rank == 1
    assert "wait in sync of step 8" in why(blame_hang(ranks), ranks)
