"""The hang rule waits while a node hosting ranks has gone quiet (controller/server.py ``_check_hangs``,
controller/liveness.py ``overdue``): its ranks and the ranks waiting for them all look silent, and a rank
waiting in an earlier step's collective looks behind the others; the node's loss is the fault. The real
controller, built and not started (no sockets)."""

from __future__ import annotations

import time

import pytest

from unbroken.config import LaunchConfig
from unbroken.controller import machine as sm
from unbroken.controller.eventlog import EventLog
from unbroken.controller.server import Controller
from unbroken.names import Phase

pytestmark = pytest.mark.timeout(30)


class _Conn:
    closed = False

    def send(self, msg) -> None:
        pass

    def send_packed(self, data) -> None:
        pass


def test_no_rank_is_blamed_for_a_hang_while_a_node_hosting_ranks_is_overdue(tmp_path):
    cfg = LaunchConfig(script="train.py", nproc_per_node=2, nnodes=2, master_port=29999, run_dir=tmp_path,
                       secret="hang-deferral-" + "0123456789abcdef" * 2)
    events = EventLog(tmp_path)
    ctl = Controller(cfg, host="127.0.0.1", port=0, events=events)
    try:
        state = sm.JobState(sm.JobPolicy(max_restarts=3, allowed=("recover-in-place", "exit")), world_size=4,
                            nnodes=2)
        for node in range(2):
            state, _ = sm.transition(state, sm.AgentJoined(node))
            ctl.board.agent_joined(node, _Conn(), standby=False)
        for r in range(4):
            state, _ = sm.transition(state, sm.SessionReady(r, 0, 0))
        ctl._state = state
        now = time.monotonic()
        for r in range(4):  # every rank's last step 20 s ago: past any timeout
            ctl.board.process_started(r, 100 + r, 0, now - 30, agent=r // 2)
            ctl.board.connected(r, _Conn(), relayed=False)
            for step in (4, 5):
                ctl.board.step_done(r, step, {}, now - 20)
            ctl.board.reported(r, Phase.SYNC if r == 1 else Phase.COMPUTE, in_loop=True)
        ctl.liveness.heard(0, now)
        ctl.liveness.heard(1, now - 10)  # node 1 has been quiet for 10 s (frozen, cut off)
        with ctl.lock:
            ctl._check_hangs(now)
        assert not ctl.state.hung_ranks  # node 1's loss will come: no rank is blamed meanwhile
        ctl.liveness.heard(1, now)  # it speaks again: a hang is a hang
        with ctl.lock:
            ctl._check_hangs(now)
        assert ctl.state.hung_ranks
    finally:
        ctl.close()
        events.close()
