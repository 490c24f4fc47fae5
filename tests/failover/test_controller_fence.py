"""A controller whose leadership term has ended stops acting at once (--controller-store): it applies
no event, says so in its event log, and closes its control port, so its agents find the new leader."""

from __future__ import annotations

import time

import pytest

from tests.conftest import EXAMPLE
from unbroken.config import LaunchConfig
from unbroken.controller import machine as sm
from unbroken.controller.eventlog import EventLog
from unbroken.controller.server import Controller
from unbroken.errors import ConnectionClosed
from unbroken.protocol.wire import connect

SECRET = "fence-test-secret-0123456789abcdefghijklm"


@pytest.mark.timeout(60)
def test_a_controller_past_its_term_applies_nothing_and_closes(tmp_path):
    cfg = LaunchConfig(script=str(EXAMPLE), nnodes=2, master_port=1, run_dir=tmp_path, secret=SECRET, job_id="j")
    holds = [True]
    events = EventLog(tmp_path)
    controller = Controller(cfg, host="127.0.0.1", port=0, events=events, term_valid=lambda: holds[0])
    controller.start()
    try:
        with controller.lock:
            controller.apply(sm.StandbyJoined(5))
        assert controller.state.standbys == {5}  # while the term holds, it acts
        holds[0] = False
        with controller.lock:
            controller.apply(sm.StandbyJoined(6))
        assert controller.state.standbys == {5}  # past it, nothing
        deadline = time.monotonic() + 10
        while not controller.fenced and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "term" in controller.fenced and events.records("controller_fenced")
        with pytest.raises(ConnectionClosed):
            connect("127.0.0.1", controller.port, SECRET.encode(), "agent", {"node_rank": 1}, timeout_s=0.5)
    finally:
        controller.close(drain_s=0)
        events.close()
