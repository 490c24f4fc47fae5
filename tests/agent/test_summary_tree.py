"""The tree of node summaries (agent/summary_tree.py): groups and their leaders, the merge, and two
nodes' relays on loopback (real authenticated connections), the member falling back to the controller when
its leader is gone. Milliseconds to a second per test, no processes."""

from __future__ import annotations

import time

import pytest

from unbroken.agent.relay import NodeRelay
from unbroken.agent.summary_tree import FANOUT, leader_of, merge
from unbroken.controller.summaries import NodeSummaries
from unbroken.protocol import messages as m

pytestmark = pytest.mark.timeout(20)

SECRET = b"summary-tree-secret-0123456789abcdef"


def _summary(done: int, age_s: float = 0.1) -> m.NodeSummary:
    return m.NodeSummary(attempt=0, nranks=2, done=done, age_s=age_s, step_s=0.2, ckpt_s=0.0, compute_s=0.1,
                         slow_rank=-1, slow_s=-1.0)


def test_groups_are_runs_of_the_hosting_agents_led_by_their_first():
    hosting = list(range(0, 2 * FANOUT + 3))
    assert leader_of(5, hosting) == 0 and leader_of(FANOUT, hosting) == FANOUT
    assert leader_of(2 * FANOUT + 2, hosting) == 2 * FANOUT
    assert leader_of(3, [1, 3, 7], fanout=2) == 1 and leader_of(7, [1, 3, 7], fanout=2) == 7
    assert leader_of(9, [1, 3, 7]) == 9  # a standby hosting nothing: on its own


def test_the_merge_ages_each_members_summary_by_how_long_the_leader_held_it():
    g = merge((10.0, _summary(7)), {4: (9.0, _summary(6, age_s=0.5))}, me=2, now=10.5)
    assert g.agents == [2, 4] and g.done == [7, 6]
    assert g.age_s == [pytest.approx(0.6), pytest.approx(2.0)]
    s = NodeSummaries()
    assert s.note_group(g, now=20.0)
    assert s.take(0, {2: 2, 4: 2}).done == 6
    assert s.heard(0, {2: 2, 4: 2}) == {2: pytest.approx(19.4), 4: pytest.approx(18.0)}
    bad = m.GroupSummary(agents=[1, 2], attempts=[0], nranks=[2, 2], done=[1, 1], age_s=[0.0, 0.0], step_s=0.1,
                         ckpt_s=0.0, compute_s=[0.1, 0.1], slow_rank=[-1, -1], slow_s=[-1.0, -1.0])
    assert not s.note_group(bad, now=21.0)  # a column short: nothing kept


class Sent:
    def __init__(self) -> None:
        self.msgs: list[m.Message] = []

    def __call__(self, msg) -> bool:
        self.msgs.append(msg)
        return True

    def of(self, kind) -> list:
        return [x for x in self.msgs if type(x) is kind]


def _wait(cond, what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.fixture
def two_nodes():
    """Agent 0 (the leader) and agent 1 (its member), each with its relay and its controller sends recorded."""
    sent = [Sent(), Sent()]
    relays = [NodeRelay(SECRET, sent[a], summaries=True) for a in (0, 1)]
    for r in relays:
        r.start()
    book = {a: ("127.0.0.1", relays[a].port) for a in (0, 1)}
    for a in (0, 1):
        relays[a].tree.set_book(a, book, hosting=[0, 1])
    try:
        yield relays, sent
    finally:
        for r in relays:
            r.close()


def test_a_member_sends_its_summary_to_its_leader_which_sends_the_groups(two_nodes):
    (leader, member), (to_ctl0, to_ctl1) = two_nodes
    member.tree.offer(_summary(5), time.monotonic())
    _wait(lambda: 1 in leader.tree._members, "the member's summary did not reach its leader")
    leader.tree.offer(_summary(6), time.monotonic())
    group = leader.tree.group_due(time.monotonic())
    assert group.agents == [0, 1] and group.done == [6, 5]
    assert leader.tree.group_due(time.monotonic()) is None  # nothing new
    assert to_ctl1.of(m.NodeSummary) == []  # the member told the controller nothing itself


def test_a_member_whose_leader_is_gone_tells_the_controller_itself(two_nodes):
    (leader, member), (_, to_ctl1) = two_nodes
    member.tree.offer(_summary(5), time.monotonic())
    _wait(lambda: member.tree.to_leader == 1, "the first summary did not go to the leader")
    leader.close()  # its node is gone
    for step in (6, 7, 8):
        member.tree.offer(_summary(step), time.monotonic())
        time.sleep(0.1)
    _wait(lambda: to_ctl1.of(m.NodeSummary), "the member never fell back to the controller")
    assert to_ctl1.of(m.NodeSummary)[-1].done == 8
