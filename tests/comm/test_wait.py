"""wait_all's two orders of checks: the abort order first (a step's collectives), or what completed
first (a commit vote: once it passed on a rank it passed, see unbroken.recovery.consistency)."""

from __future__ import annotations

import time

import pytest

from unbroken.comm import wait_all
from unbroken.errors import CollectiveAborted

pytestmark = pytest.mark.timeout(30)


class FakeWork:
    def __init__(self, done: bool) -> None:
        self.done = done

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> bool:
        return True


def test_an_abort_order_wins_over_a_completed_collective_of_the_step():
    graveyard: list = []
    with pytest.raises(CollectiveAborted):
        wait_all([FakeWork(True)], lambda: True, graveyard, "all-reduce of step 3")


def test_a_completed_commit_vote_passes_even_after_the_abort_order():
    graveyard: list = []
    wait_all([FakeWork(True)], lambda: True, graveyard, "commit vote of step 3", vote_grace_s=0.2)
    assert graveyard == []


def test_an_unfinished_commit_vote_aborts_after_its_grace_and_stays_referenced():
    graveyard: list = []
    work = FakeWork(False)
    start = time.monotonic()
    with pytest.raises(CollectiveAborted, match="commit vote of step 3 aborted"):
        wait_all([work], lambda: True, graveyard, "commit vote of step 3", vote_grace_s=0.2)
    assert time.monotonic() - start >= 0.2 and graveyard == [work]


def test_a_commit_vote_completing_within_its_grace_after_the_order_passes():
    """Every rank joined the vote; the order came while its data was in flight: it passes here too."""

    class LateWork(FakeWork):
        polls = 0

        def is_completed(self) -> bool:
            self.polls += 1
            return self.polls > 5

    graveyard: list = []
    wait_all([LateWork(False)], lambda: True, graveyard, "commit vote of step 3", vote_grace_s=5.0)
    assert graveyard == []
