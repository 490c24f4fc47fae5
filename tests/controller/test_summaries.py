"""The nodes' summaries at the controller (controller/summaries.py), and what a watchdog tick makes of
them (controller/server.py ``_take_summaries``): the commit record, the live view's job step, the
straggler rule. The real controller, built and not started (no sockets)."""

from __future__ import annotations

import pytest

from unbroken.config import LaunchConfig
from unbroken.controller import machine as sm
from unbroken.controller.connections import AGENT_HANDLERS, Connections
from unbroken.controller.eventlog import EventLog
from unbroken.controller.server import Controller
from unbroken.controller.summaries import NodeSummaries
from unbroken.protocol import messages as m

pytestmark = pytest.mark.timeout(30)


def _summary(done: int, *, attempt: int = 0, nranks: int = 2, age_s: float = 0.1, compute_s: float = 0.1,
             slow_rank: int = -1, slow_s: float = -1.0) -> m.NodeSummary:
    return m.NodeSummary(attempt=attempt, nranks=nranks, done=done, age_s=age_s, step_s=0.2, ckpt_s=0.01,
                         compute_s=compute_s, slow_rank=slow_rank, slow_s=slow_s)


def test_the_job_step_is_the_least_over_every_hosting_node_of_the_attempt():
    s = NodeSummaries()
    hosting = {0: 2, 1: 2}
    assert s.take(0, hosting) is None  # nothing came
    s.note(0, _summary(7), now=10.0)
    assert s.take(0, hosting) is None  # node 1 has said nothing yet
    s.note(1, _summary(5), now=10.0)
    assert s.take(0, hosting).done == 5
    assert s.take(0, hosting) is None  # nothing new since
    s.note(1, _summary(6, nranks=1), now=11.0)  # a rank of node 1 not covered (a replacement not in yet)
    assert s.take(0, hosting) is None
    s.note(1, _summary(9, attempt=1), now=11.0)  # another attempt's
    assert s.take(0, hosting) is None
    assert s.heard(0, hosting) == {0: pytest.approx(9.9)}  # node 1's summary vouches for nothing of attempt 0
    s.forget(0)
    assert s.heard(0, hosting) == {}


def test_a_nodes_slowest_rank_past_the_factor_of_the_nodes_medians_is_a_straggler():
    s = NodeSummaries()
    s.note(0, _summary(9, compute_s=0.10, slow_rank=1, slow_s=0.11), now=1.0)
    assert s.stragglers(0, factor=2.0) == []  # one node, no rank past twice its median
    s.note(1, _summary(9, compute_s=0.10, slow_rank=3, slow_s=0.40), now=1.0)
    s.note(2, _summary(9, compute_s=0.12, slow_rank=-1, slow_s=-1.0), now=1.0)
    assert s.stragglers(0, factor=2.0) == []  # node 2 has not its ranks' windows yet
    s.note(2, _summary(9, compute_s=0.12, slow_rank=5, slow_s=0.13), now=1.0)
    assert s.stragglers(0, factor=2.0) == [(3, 0.40, 0.10)]


@pytest.fixture
def controller(tmp_path):
    """A 4-rank job on two nodes, mid-job (as benchmarks/controller_scale.py sets it)."""
    cfg = LaunchConfig(script="train.py", nproc_per_node=2, nnodes=2, master_port=29999, run_dir=tmp_path,
                       secret="summaries-test-" + "0123456789abcdef" * 2)  # (a port: a config check; unused)
    events = EventLog(tmp_path)
    ctl = Controller(cfg, host="127.0.0.1", port=0, events=events)
    state = sm.JobState(sm.JobPolicy(max_restarts=3, allowed=("recover-in-place", "exit")), world_size=4, nnodes=2)
    for node in range(2):
        state, _ = sm.transition(state, sm.AgentJoined(node))
    for r in range(4):
        state, _ = sm.transition(state, sm.SessionReady(r, 0, 0))
    ctl._state = state
    try:
        yield ctl, Connections(ctl), events
    finally:
        ctl.close()
        events.close()


def test_a_tick_records_the_step_every_node_completed_committed_and_logs_the_job_step(controller):
    ctl, handling, events = controller
    steps = []
    ctl.add_job_step_listener(lambda step, fields: steps.append((step, fields)))
    with ctl.lock:
        AGENT_HANDLERS[m.NodeSummary](handling, 0, _summary(12))
        ctl._take_summaries()
        assert ctl.state.committed_step == -1 and steps == []  # node 1 has said nothing
        AGENT_HANDLERS[m.NodeSummary](handling, 1, _summary(10))
        ctl._take_summaries()
    assert ctl.state.committed_step == 9  # every rank completed 10 steps: step 9 committed (worker/commit.py)
    assert steps == [(10, {"step_s": 0.2, "ckpt_s": 0.01})]
    with ctl.lock:
        AGENT_HANDLERS[m.NodeSummary](handling, 1, _summary(3, attempt=7))  # another attempt's: not kept
        ctl._take_summaries()
    assert ctl.state.committed_step == 9 and len(steps) == 1
