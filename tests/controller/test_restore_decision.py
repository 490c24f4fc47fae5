"""The restore point: the newest step every rank's part of which is committed in some tier."""

from __future__ import annotations

import itertools

import pytest

from unbroken.recovery.restore_point import RankOffer, decide_restore


def offers(*per_rank: tuple[list[int], list[int]]) -> dict[int, RankOffer]:
    """Offers of ranks 0, 1, ... from (memory steps, storage steps) pairs."""
    return {rank: RankOffer.of(memory, storage) for rank, (memory, storage) in enumerate(per_rank)}


def test_every_rank_in_memory_loads_from_memory():
    point = decide_restore(offers(([10, 5], [5]), ([10, 5], [5])), 2)
    assert (point.step, point.tiers, point.tier) == (10, ("memory", "memory"), "memory")
    assert "step 10" in point.reason


def test_memory_first_then_storage_per_rank():
    # Rank 1's node lost its shared memory (a new node); its part of step 10 is in storage.
    point = decide_restore(offers(([10], [10, 5]), ([], [10, 5]), ([10], [])), 3)
    assert (point.step, point.tiers, point.tier) == (10, ("memory", "storage", "memory"), "mixed")
    assert "memory on ranks [0, 2]" in point.reason and "storage on ranks [1]" in point.reason


def test_all_storage():
    point = decide_restore(offers(([], [20, 10]), ([], [20, 10])), 2)
    assert (point.step, point.tier) == (20, "storage")


def test_a_rank_missing_the_newest_step_makes_the_job_go_older():
    # Rank 2 never committed step 15 anywhere (it died mid-copy): 15 is not restorable.
    point = decide_restore(offers(([15, 10], [10]), ([15, 10], [10]), ([10], [10]), ([15, 10], [])), 4)
    assert point.step == 10 and point.tiers == ("memory",) * 4
    assert "newer step 15 is not committed on ranks [2]" in point.reason


def test_a_step_only_in_another_tier_on_some_ranks_still_counts():
    # Step 8 is in memory on rank 0 only, and in storage on rank 1 only (a dump).
    point = decide_restore(offers(([8, 5], []), ([5], [8])), 2)
    assert (point.step, point.tiers) == (8, ("memory", "storage"))


def test_nothing_at_all_starts_fresh():
    point = decide_restore(offers(([], []), ([], [])), 2)
    assert (point.step, point.tiers, point.tier) == (-1, (), "none")
    assert "ranks [0, 1] have no committed step" in point.reason and "starts fresh" in point.reason


def test_no_common_step_starts_fresh():
    point = decide_restore(offers(([10], []), ([], [5])), 2)
    assert point.step == -1
    assert "no step is committed for every rank" in point.reason and "rank 0: 10, rank 1: 5" in point.reason


def test_one_rank_without_anything_starts_fresh():
    point = decide_restore(offers(([10], [10]), ([], []), ([10], [])), 3)
    assert point.step == -1 and "ranks [1] have no committed step" in point.reason


def test_bounds_across_rounds_go_strictly_older():
    ranks = offers(([20, 15], [20, 10, 5]), ([20, 15], [20, 10, 5]))
    first = decide_restore(ranks, 2)
    assert first.step == 20
    # Some rank could not load step 20 (rotted in place): the next round is older than 20.
    second = decide_restore(ranks, 2, below=first.step)
    assert (second.step, second.tier) == (15, "memory") and "below step 20" in second.reason
    third = decide_restore(ranks, 2, below=second.step)
    assert (third.step, third.tier) == (10, "storage")
    assert decide_restore(ranks, 2, below=5).step == -1
    # Rounds always end: each one is strictly older than the one before.
    below, seen = None, []
    while (point := decide_restore(ranks, 2, below=below)).step >= 0:
        seen.append(point.step)
        below = point.step
    assert seen == [20, 15, 10, 5]


def test_negative_steps_are_ignored():
    assert decide_restore(offers(([-1, 3], []), ([3, -7], [])), 2).step == 3


def test_every_rank_must_have_offered():
    with pytest.raises(ValueError, match=r"missing ranks \[1\]"):
        decide_restore(offers(([10], [])), 2)
    with pytest.raises(ValueError, match=r"unknown ranks \[2\]"):
        decide_restore({0: RankOffer(), 2: RankOffer()}, 2)


def test_big_jobs_keep_the_reason_short():
    world = 1000
    ranks = {rank: RankOffer.of([10] if rank % 2 else [], [10]) for rank in range(world)}
    point = decide_restore(ranks, world)
    assert point.step == 10 and point.tier == "mixed" and len(point.tiers) == world
    assert "and 492 more" in point.reason and len(point.reason) < 300


def test_decision_is_the_newest_common_step_over_small_cases():
    """Against a brute force: every way 3 ranks can hold steps 1 and 2 in the two tiers."""
    steps = (1, 2)
    holdings = list(itertools.product([0, 1, 2, 3], repeat=len(steps)))  # bit 0: memory, bit 1: storage
    for case in itertools.product(holdings, repeat=3):  # per rank: its holding of each step
        ranks = {rank: RankOffer.of([s for s, h in zip(steps, held) if h & 1],
                                    [s for s, h in zip(steps, held) if h & 2])
                 for rank, held in enumerate(case)}
        common = [s for s in steps if all(s in offer.steps for offer in ranks.values())]
        point = decide_restore(ranks, 3)
        assert point.step == max(common, default=-1), case
        if point.step >= 0:
            assert point.tiers == tuple("memory" if point.step in ranks[r].memory_steps else "storage"
                                        for r in range(3)), case
