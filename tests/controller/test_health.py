"""The straggler rule, on timings alone."""

from unbroken.controller.health import WINDOW, describe, stragglers


def times(*medians, n=WINDOW):
    return {rank: [m] * n for rank, m in enumerate(medians)}


def test_a_rank_three_times_slower_is_a_straggler():
    ((rank, median, job),) = stragglers(times(0.1, 0.1, 0.35, 0.1), factor=3)
    assert (rank, median, job) == (2, 0.35, 0.1)
    assert describe(median, job).startswith("straggler: median compute time 0.350 s over its last 10 steps, 3.5x")


def test_no_verdict_before_every_rank_has_a_window_or_when_off():
    assert stragglers(times(0.1, 0.1, 0.5, 0.1, n=WINDOW - 1), factor=3) == []
    assert stragglers(times(0.1, 0.1, 0.5, 0.1), factor=0) == []
    assert stragglers({0: [0.1] * WINDOW}, factor=3) == []


def test_tiny_steps_jitter_is_not_a_straggler():
    assert stragglers(times(0.001, 0.001, 0.02, 0.001), factor=3) == []  # 20x, but only 19 ms


def test_only_the_last_window_counts():
    history = times(0.1, 0.1, 0.1, 0.1)
    history[1] = [1.0] * 50 + [0.1] * WINDOW  # slow long ago, recovered since
    assert stragglers(history, factor=3) == []
