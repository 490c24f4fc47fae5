"""A steady step, and a steady watchdog tick, cost the controller work linear in the ranks, never
quadratic: no handler of a rank's per-step report may walk every rank (the straggler rule does once
per step, on rank 0's), and a tick walks them once.

The real controller (built, not started: no sockets), its real handlers and state machine, each
node's relayed batch of 8 ranks' reports as the wire delivers it (agent/relay.py). What is
counted is how many rank views the step's handling iterates: a walk per report is N per rank,
N^2 per step, which a 256-rank job already shows as 65,536 against ~500 (the bug that made
the step row of benchmarks/controller_scale.py 10x slower per rank at 16k than at 1k ranks).
"""

from __future__ import annotations

import time

import msgpack
import pytest

from unbroken.config import LaunchConfig
from unbroken.controller import machine as sm
from unbroken.controller.connections import AGENT_HANDLERS, Connections
from unbroken.controller.eventlog import EventLog
from unbroken.controller.health import WINDOW
from unbroken.controller import watchdog as watchdog_module
from unbroken.controller.server import Controller
from unbroken.protocol import messages as m
from unbroken.protocol.framing import pack_frame
from unbroken.protocol.schema import decode, encode

N, PER_NODE = 256, 8


class _Conn:
    def send(self, msg) -> None:
        pass

    def send_packed(self, data) -> None:
        pass


def _started_state(n: int) -> sm.JobState:
    state = sm.JobState(sm.JobPolicy(max_restarts=3, allowed=("recover-in-place", "exit")), world_size=n,
                        nnodes=n // PER_NODE)
    for node in range(state.nnodes):
        state, _ = sm.transition(state, sm.AgentJoined(node))
    for r in range(n):
        state, _ = sm.transition(state, sm.SessionReady(r, 0, 0))
    return state


def _batches(step: int) -> list[tuple[int, m.NodeReports]]:
    msgs = [m.Progress(rank=r, attempt=0, step=step, phase="compute", state=b"s" * 16, done=True,
                       metrics={"loss": 1.0, "step_s": 0.5, "compute_s": 0.3, "ckpt_s": 0.0}) for r in range(N)]
    msgs += [m.StepSynced(rank=r, attempt=0, gen=0, step=step, state=b"t" * 16) for r in range(N)]
    out = []
    for node in range(N // PER_NODE):
        mine = [x for x in msgs if x.rank // PER_NODE == node]
        frame = pack_frame(encode(m.NodeReports(entries=[encode(x) for x in mine], pids=[1000 + x.rank for x in mine])))
        out.append((node, decode(msgpack.unpackb(frame[4:], raw=False))))
    return out


@pytest.fixture
def steady(tmp_path):
    """The controller mid-job, every rank's step times in (the straggler window): (controller, step)."""
    cfg = LaunchConfig(script="train.py", nproc_per_node=N, run_dir=tmp_path, secret="s" * 32)
    events = EventLog(tmp_path)
    ctl = Controller(cfg, host="127.0.0.1", port=0, events=events)
    try:
        ctl._state = _started_state(N)  # mid-job (as benchmarks/controller_scale.py sets it)
        for r in range(N):
            ctl.board.process_started(r, 1000 + r, 0, 0.0)
            ctl.board.connected(r, _Conn(), relayed=True)
        for node in range(N // PER_NODE):
            ctl.board.agent_joined(node, _Conn(), standby=False)
        handling = Connections(ctl)

        def step(k: int) -> None:
            for node, msg in _batches(k):
                with ctl.lock:
                    AGENT_HANDLERS[type(msg)](handling, node, msg)

        for k in range(1, WINDOW + 2):  # warm: every rank's step times for the straggler rule
            step(k)
        yield ctl, step
    finally:
        ctl.close()
        events.close()


def _count_walks(ctl: Controller, monkeypatch) -> list[int]:
    walked = [0]
    views = ctl.board.views

    def counted():
        for view in views():
            walked[0] += 1
            yield view

    monkeypatch.setattr(ctl.board, "views", counted)
    return walked


def test_a_steady_step_walks_the_ranks_a_bounded_number_of_times(steady, monkeypatch):
    ctl, step = steady
    walked = _count_walks(ctl, monkeypatch)
    step(WINDOW + 2)
    assert ctl.state.committed_step == WINDOW + 2
    assert walked[0] <= 4 * N, f"one step walked {walked[0]} rank views for {N} ranks (quadratic: {N * N})"


def test_a_steady_watchdog_tick_walks_the_ranks_once_and_sorts_the_step_times_once(steady, monkeypatch):
    """Ten times a second the watchdog looks for hangs: in a steady job that is one pass over the ranks
    (nobody past the shortest timeout, no process stopped), and the step times' percentile is computed
    once, not once per rank (it was: 1.4 s of CPU per second at 16k ranks, benchmarks/controller_scale.py
    row ``watch``)."""
    ctl, _ = steady
    sorts = [0]

    def counted_sorted(*args, **kwargs):
        sorts[0] += 1
        return sorted(*args, **kwargs)

    monkeypatch.setattr(watchdog_module, "sorted", counted_sorted, raising=False)
    walked = _count_walks(ctl, monkeypatch)
    now = time.monotonic()
    with ctl.lock:
        ctl._check_after_loop(now)
        ctl._check_hangs(now)
    assert not ctl.state.hung_ranks
    assert walked[0] <= 2 * N, f"one tick walked {walked[0]} rank views for {N} ranks"
    assert sorts[0] <= 1, f"one tick sorted the step times {sorts[0]} times for {N} ranks"
