"""A steady step costs the controller work linear in the ranks, never quadratic: no handler of a
rank's per-step report may walk every rank (the straggler rule does once per step, on rank 0's).

The real controller (built, not started: no sockets), its real handlers and state machine, each
node's relayed batch of 8 ranks' reports as the wire delivers it (agent/relay.py). What is
counted is how many rank views the step's handling iterates: a walk per report is N per rank,
N^2 per step, which a 256-rank job already shows as 65,536 against ~500 (the bug that made
the step row of benchmarks/controller_scale.py 10x slower per rank at 16k than at 1k ranks).
"""

from __future__ import annotations

import msgpack

from unbroken.config import LaunchConfig
from unbroken.controller import machine as sm
from unbroken.controller.connections import AGENT_HANDLERS, Connections
from unbroken.controller.eventlog import EventLog
from unbroken.controller.health import WINDOW
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


def test_a_steady_step_walks_the_ranks_a_bounded_number_of_times(tmp_path, monkeypatch):
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
        walked = [0]
        views = ctl.board.views

        def counted():
            for view in views():
                walked[0] += 1
                yield view

        monkeypatch.setattr(ctl.board, "views", counted)
        step(WINDOW + 2)
        assert ctl.state.committed_step == WINDOW + 2
        assert walked[0] <= 4 * N, f"one step walked {walked[0]} rank views for {N} ranks (quadratic: {N * N})"
    finally:
        ctl.close()
        events.close()
