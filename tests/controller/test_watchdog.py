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
    ws = views({0: Phase.SYNC, 1: Phase.COMPUTE, 2: Phase.COMPUTE, 3: Phase.SYNC}, silent_s=0.5)
    ws[1].process, ws[1].process_t = "stopped", NOW - 1.1
    blamed, why = dog.find_hung(ws, 0, NOW)
    assert blamed.rank == 1 and why == "its process is stopped"
    ws[1].process_t = NOW - 0.9
    assert dog.find_hung(ws, 0, NOW) is None


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
