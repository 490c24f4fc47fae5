"""Node liveness (controller/liveness.py) and an agent's watch on its controller (agent/fence.py)."""

from __future__ import annotations

import threading
import time

import pytest

from unbroken.agent.fence import ControllerWatch
from unbroken.config import LaunchConfig
from unbroken.controller.liveness import Liveness, beat_interval_s, fence_after_s
from unbroken.errors import ConfigError
from unbroken.protocol import messages as m


def test_an_agent_is_silent_only_past_the_timeout():
    live = Liveness(10.0)
    live.heard(1, now=100.0)
    live.heard(2, now=105.0)
    assert live.silent(110.0) == []
    assert live.silent(110.5) == [(1, 10.5)]
    live.heard(1, now=110.6)
    assert live.silent(115.5) == [(2, 10.5)]
    assert live.forget(2) == 105.0 and live.silent(200.0) == [(1, 89.4)]


def test_beats_are_due_once_per_interval():
    live = Liveness(4.0)  # T / 5
    assert live.beat_due(0.0) and not live.beat_due(0.7) and live.beat_due(0.8)
    live = Liveness(30.0)  # at most a second apart
    assert live.beat_due(0.0) and not live.beat_due(0.9) and live.beat_due(1.0)


def test_a_node_fences_itself_well_before_the_controller_can_declare_it_lost():
    # The cut silences both ends at once; the agent's last word from the controller is at most one
    # beat old. Fence at <= cut + T/2, declared at >= cut - beat + T: a margin of at least 0.3 T.
    for t in (1.0, 5.0, 30.0):
        assert t - beat_interval_s(t) - fence_after_s(t) >= 0.3 * t - 1e-9
    assert beat_interval_s(30.0) == 1.0  # (a beat a second at most apart: an overdue agent is seen in 2.5 s)


def test_an_agent_silent_for_a_few_beats_is_overdue():
    live = Liveness(30.0)
    live.heard(0, 100.0)
    live.heard(1, 97.0)
    assert live.overdue(100.0, [0, 1, 2]) == [1]  # (2 never heard: not watched)
    assert live.overdue(100.0, [0]) == []


def test_node_timeout_is_checked_at_the_edge():
    with pytest.raises(ConfigError, match="--node-timeout-s"):
        LaunchConfig(script="x.py", node_timeout_s=0)
    assert LaunchConfig(script="x.py", node_timeout_s=2.5).node_timeout_s == 2.5


@pytest.mark.timeout(20)
def test_the_watch_beats_and_fences_once_when_the_controller_is_silent():
    sent, fenced = [], []
    done = threading.Event()
    watch = ControllerWatch(3, 1.0, lambda msg: sent.append(msg) or True,
                            lambda silent_s: (fenced.append(silent_s), done.set()))
    watch.start()
    for _ in range(6):  # the controller talks for 0.6 s: no fence
        time.sleep(0.1)
        watch.heard()
    assert not fenced
    assert done.wait(5)
    time.sleep(0.2)
    watch.stop()
    assert len(fenced) == 1 and fenced[0] > 0.5
    assert sent and all(msg == m.Heartbeat(rank=3) for msg in sent)
