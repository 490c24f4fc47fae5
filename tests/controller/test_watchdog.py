"""The watchdog's timeouts: a rank with evidence against it is blamed after max(1 s, 3 x p99 step),
one without evidence only after the conservative floor (issue 30: hangs found in about a second,
never the wrong rank). Pure: views and clocks are made up, no processes."""

from __future__ import annotations

import pytest

from unbroken.config import HangConfig
from unbroken.controller.views import RankView
from unbroken.controller.watchdog import Watchdog
from unbroken.names import Phase, WorkerState

NOW = 1000.0


def views(phases: dict[int, str], silent_s: float = 0.0, steps: int = 5) -> list[RankView]:
    return [RankView(rank=r, attempt=0, state=WorkerState.RUNNING, phase=p, last_progress_t=NOW - silent_s,
                       steps_in_generation=steps, in_step_loop=True) for r, p in phases.items()]


def watchdog(step_s: float = 0.1, n: int = 50, **hang) -> Watchdog:
    dog = Watchdog(HangConfig(**hang), straggler_factor=0.0)
    for _ in range(n):
        dog.note_step_s(step_s)
    return dog


def test_p99_not_the_median_scales_the_timeouts():
    dog = watchdog(0.1, n=98)
    dog.note_step_s(2.0)
    dog.note_step_s(2.0)  # two slow steps in 100: the p99 sees them, the median does not
    assert dog.median_step_s() == 0.1
    assert dog.p99_step_s() == 2.0
    assert dog.evidence_timeout_s() == pytest.approx(6.0)
    assert dog.steady_timeout_s() == pytest.approx(6.0)
    quick = watchdog(0.1)
    assert (quick.evidence_timeout_s(), quick.steady_timeout_s()) == (1.0, 5.0)


def test_the_rank_every_peer_waits_for_is_blamed_after_about_a_second():
    dog = watchdog(0.1)
    ws = views({0: Phase.SYNC, 1: Phase.SYNC, 2: Phase.COMPUTE, 3: Phase.SYNC}, silent_s=1.2)
    blamed, why = dog.find_hung(ws, 0, NOW)
    assert blamed.rank == 2 and "never reached the collective" in why
    early = views({0: Phase.SYNC, 1: Phase.SYNC, 2: Phase.COMPUTE, 3: Phase.SYNC}, silent_s=0.8)
    assert dog.find_hung(early, 0, NOW) is None


def test_without_evidence_the_conservative_floor_holds():
    dog = watchdog(0.1)
    # two ranks not in the collective: no single culprit the others wait for
    ws = views({0: Phase.SYNC, 1: Phase.COMPUTE, 2: Phase.COMPUTE, 3: Phase.SYNC}, silent_s=3.0)
    assert dog.find_hung(ws, 0, NOW) is None
    # every rank silent in the collective alike (a hang inside it)
    ws = views({0: Phase.SYNC, 1: Phase.SYNC, 2: Phase.SYNC, 3: Phase.SYNC}, silent_s=3.0)
    assert dog.find_hung(ws, 0, NOW) is None
    ws = views({0: Phase.SYNC, 1: Phase.SYNC, 2: Phase.SYNC, 3: Phase.SYNC}, silent_s=5.5)
    assert dog.find_hung(ws, 0, NOW) is not None


def test_a_stopped_process_is_blamed_about_a_second_after_its_agent_saw_it():
    dog = watchdog(0.1)
    ws = views({0: Phase.SYNC, 1: Phase.COMPUTE, 2: Phase.UPDATE, 3: Phase.SYNC}, silent_s=0.5)
    for w, step in zip(ws, (5, 5, 4, 5)):
        w.step = step  # rank 2 still in step 4: no short cut (below), the evidence timeout
    ws[1].process, ws[1].process_t = "stopped", NOW - 1.1
    blamed, why = dog.find_hung(ws, 0, NOW)
    assert blamed.rank == 1 and why == "its process is stopped"
    ws[1].process_t = NOW - 0.9
    assert dog.find_hung(ws, 0, NOW) is None


def test_a_stopped_process_no_peer_is_behind_is_blamed_after_two_looks_of_its_agent():
    dog = watchdog(2.0)  # long steps: the calibrated evidence timeout is 6 s; a stopped process needs none
    ws = views({0: Phase.SYNC, 1: Phase.COMPUTE, 2: Phase.VOTE, 3: Phase.COMPUTE}, silent_s=0.3)
    ws[1].process, ws[1].process_t = "stopped", NOW - 0.3
    blamed, why = dog.find_hung(ws, 0, NOW)
    assert blamed.rank == 1 and why == "its process is stopped"
    ws[1].process_t = NOW - 0.2  # seen stopped once only: a profiler's sample may stop it that long
    assert dog.find_hung(ws, 0, NOW) is None
    # stopped inside the collective with all the others: they cannot finish it without it either
    inside = views({0: Phase.VOTE, 1: Phase.VOTE, 2: Phase.VOTE}, silent_s=0.3)
    inside[2].process, inside[2].process_t = "stopped", NOW - 0.3
    assert dog.find_hung(inside, 0, NOW)[0].rank == 2
    # stopped in the vote of step 5 while the others compute step 6: they will wait for it in its reduction
    ahead = views({0: Phase.COMPUTE, 1: Phase.VOTE, 2: Phase.COMPUTE}, silent_s=0.3)
    for w, step in zip(ahead, (6, 5, 6)):
        w.step = step
    ahead[1].process, ahead[1].process_t = "stopped", NOW - 0.3
    assert dog.find_hung(ahead, 0, NOW)[0].rank == 1


def test_a_stopped_process_a_peer_is_behind_keeps_the_evidence_timeout():
    dog = watchdog(0.1)
    ws = views({0: Phase.UPDATE, 1: Phase.COMPUTE, 2: Phase.SYNC}, silent_s=0.5)
    for w, step in zip(ws, (4, 5, 5)):
        w.step = step  # rank 0 is still in step 4: it may be the one the others wait for
    ws[1].process, ws[1].process_t = "stopped", NOW - 0.5
    assert dog.find_hung(ws, 0, NOW) is None  # 1 s as before
    ws[1].process_t = NOW - 1.1
    assert dog.find_hung(ws, 0, NOW)[0].rank == 1
    fixed = watchdog(0.1, timeout_s=2.0)  # a fixed --hang-timeout-s applies to a stopped process too
    ws = views({0: Phase.SYNC, 1: Phase.COMPUTE, 2: Phase.SYNC}, silent_s=0.5)
    ws[1].process, ws[1].process_t = "stopped", NOW - 1.5
    assert fixed.find_hung(ws, 0, NOW) is None
    first = views({0: Phase.SYNC, 1: Phase.COMPUTE, 2: Phase.SYNC}, silent_s=0.5, steps=0)
    first[1].process, first[1].process_t = "stopped", NOW - 0.5
    assert dog.find_hung(first, 0, NOW) is None  # a generation's first step: the steady timeout from the look


def test_the_first_step_of_a_generation_keeps_its_own_timeout():
    dog = watchdog(0.1)
    ws = views({0: Phase.SYNC, 1: Phase.COMPUTE}, silent_s=10.0, steps=0)  # a replacement importing torch
    assert dog.find_hung(ws, 0, NOW) is None


def test_slow_steps_raise_the_evidence_timeout():
    dog = watchdog(0.8)  # 3 x 0.8 s = 2.4 s
    ws = views({0: Phase.SYNC, 1: Phase.COMPUTE}, silent_s=2.0)
    assert dog.find_hung(ws, 0, NOW) is None
    ws = views({0: Phase.SYNC, 1: Phase.COMPUTE}, silent_s=2.5)
    assert dog.find_hung(ws, 0, NOW)[0].rank == 1


def test_a_fixed_hang_timeout_wins_everywhere():
    dog = watchdog(0.1, timeout_s=7.0)
    assert dog.evidence_timeout_s() == dog.steady_timeout_s() == 7.0
    ws = views({0: Phase.SYNC, 1: Phase.COMPUTE}, silent_s=3.0)
    assert dog.find_hung(ws, 0, NOW) is None


def test_a_nodes_summary_counts_as_its_ranks_being_heard():
    """Node summaries (agent/held_reports.py): a rank whose own reports stay on its node is heard when its
    node says all its ranks reported; a node that stopped saying so leaves its ranks' silence to run."""
    dog = watchdog(0.1)
    ws = views({0: Phase.COMPUTE, 1: Phase.COMPUTE}, silent_s=8.0)  # last reports 8 s ago, held since
    for w in ws:
        w.agent = w.rank  # one rank a node
    assert dog.find_hung(ws, 0, NOW, heard={0: NOW - 0.5, 1: NOW - 0.5}) is None
    assert dog.find_hung(ws, 0, NOW, heard={0: NOW - 0.5, 1: NOW - 6.0}) is not None  # node 1 silent: past 5 s
    assert dog.find_hung(ws, 0, NOW) is not None  # (without summaries: 8 s of silence)
