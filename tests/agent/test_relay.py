"""Per-node aggregation of the step reports (agent/relay.py) and a worker's side of it
(worker/control.py): real authenticated local connections, a recording send for the agent's
controller connection, a stand-in controller socket. Milliseconds per test, no processes."""

from __future__ import annotations

import contextlib
import queue
import threading
import time

import pytest

from unbroken.agent.relay import NodeRelay
from unbroken.protocol import messages as m
from unbroken.protocol.wire import Server, connect
from unbroken.worker.control import LOST_CONTROLLER_GEN, ControlClient

pytestmark = pytest.mark.timeout(20)

SECRET = b"relay-test-secret-0123456789abcdef"
DELAY_S = 0.3


class Sent:
    """The agent's controller connection: records what the relay sends."""

    def __init__(self) -> None:
        self.msgs: list[m.NodeReports] = []
        self.cv = threading.Condition()

    def __call__(self, msg) -> bool:
        with self.cv:
            self.msgs.append(msg)
            self.cv.notify_all()
        return True

    def wait(self, count: int, timeout_s: float = 5.0) -> list[m.NodeReports]:
        with self.cv:
            assert self.cv.wait_for(lambda: len(self.msgs) >= count, timeout_s), f"{len(self.msgs)} of {count} sent"
            return list(self.msgs)

    def entries(self, i: int) -> list[tuple[int, m.Message]]:
        return [(pid, m.decode(e)) for pid, e in zip(self.msgs[i].pids, self.msgs[i].entries)]


@pytest.fixture
def relay():
    sent = Sent()
    node = NodeRelay(SECRET, sent, delay_s=DELAY_S)
    node.start()
    yield node, sent
    node.close()


def _worker(node: NodeRelay, rank: int):
    host, port = node.address.rsplit(":", 1)
    return connect(host, int(port), SECRET, "relay", {"rank": rank, "pid": 1000 + rank, "attempt": 0})


def _connected(node: NodeRelay, count: int) -> None:
    deadline = time.monotonic() + 5
    while len(node._conns) < count:
        assert time.monotonic() < deadline, "the workers did not connect"
        time.sleep(0.005)


@contextlib.contextmanager
def _workers(node: NodeRelay, count: int):
    """``count`` ranks connected to the relay (ranks 0..count-1), closed on the way out, failing or not."""
    conns = [_worker(node, r) for r in range(count)]
    try:
        _connected(node, count)
        yield conns
    finally:
        for c in conns:
            c.close()


def _compute(rank: int, step: int) -> m.Progress:
    return m.Progress(rank=rank, attempt=0, step=step, phase="compute", metrics={}, state=b"own%d" % rank)


def test_a_nodes_batch_goes_once_it_carries_every_local_rank(relay):
    node, sent = relay
    with _workers(node, 3) as conns:
        for r in (2, 0):
            conns[r].send(_compute(r, 5))
        time.sleep(0.05)
        assert sent.msgs == []  # rank 1 has not reported step 5 yet
        conns[1].send(_compute(1, 5))
        sent.wait(1)
        assert sorted((pid, e.rank, e.step, e.state) for pid, e in sent.entries(0)) == [
            (1000, 0, 5, b"own0"), (1001, 1, 5, b"own1"), (1002, 2, 5, b"own2")]  # one batch, states kept
        for r in range(3):
            conns[r].send(m.StepSynced(rank=r, attempt=0, gen=0, step=5))
        sent.wait(2)
        assert sorted(e.rank for _, e in sent.entries(1)) == [0, 1, 2] and node.batches_sent == 2


def test_a_missing_rank_holds_the_batch_until_the_delay_then_the_others_go(relay):
    node, sent = relay
    with _workers(node, 3) as conns:
        for r in (0, 1):
            conns[r].send(m.StepSynced(rank=r, attempt=0, gen=0, step=7))
        deadline = time.monotonic() + 5
        while len(node._buffer) < 2:  # both taken in (the relay's threads)
            assert time.monotonic() < deadline
            time.sleep(0.005)
        node.flush_due(time.monotonic())
        assert sent.msgs == []  # rank 2 missing, the delay not over: the controller cannot commit step 7 yet
        node.flush_due(time.monotonic() + DELAY_S)  # the agent's watcher does this every 50 ms
        assert sorted(e.rank for _, e in sent.entries(0)) == [0, 1]  # the hang rule sees them in sync within the delay


def test_a_pause_and_a_lone_mark_go_at_once_after_what_came_before(relay):
    node, sent = relay
    with _workers(node, 2) as conns:
        conns[0].send(_compute(0, 3))
        conns[0].send(m.RankPaused(rank=0, attempt=0, gen=1, step=3, phase="compute"))
        sent.wait(1)
        assert [type(e).__name__ for _, e in sent.entries(0)] == ["Progress", "RankPaused"]


def test_a_dead_ranks_last_reports_go_before_its_exit_is_reported(relay):
    node, sent = relay
    conns = [_worker(node, r) for r in range(2)]
    _connected(node, 2)
    conns[1].send(m.StepSynced(rank=1, attempt=0, gen=0, step=2))
    conns[1].close()  # the process died
    node.rank_gone(1)  # the agent's watcher, before it sends RankExited
    assert [e.rank for _, e in sent.entries(0)] == [1]
    conns[0].close()


def test_another_ranks_report_and_other_messages_are_dropped(relay):
    node, sent = relay
    conn = _worker(node, 0)
    _connected(node, 1)
    conn.send(m.StepSynced(rank=1, attempt=0, gen=0, step=2))  # not its own rank
    conn.send(m.ClaimFault(rank=0, fault_id="f"))  # not a step report
    conn.send(m.StepSynced(rank=0, attempt=0, gen=0, step=2))
    sent.wait(1)
    assert [(e.TYPE, e.rank) for _, e in sent.entries(0)] == [("step_synced", 0)]
    conn.close()


def test_a_batch_with_big_states_is_cut_to_fit_the_frame(relay):
    node, sent = relay
    conns = [_worker(node, r) for r in range(3)]
    _connected(node, 3)
    for r in range(3):
        conns[r].send(m.Progress(rank=r, attempt=0, step=1, phase="compute", metrics={},
                                 state=bytes(m.PER_RANK_LIMIT_BYTES)))
    sent.wait(2)
    time.sleep(0.05)
    assert sorted(e.rank for i in range(len(sent.msgs)) for _, e in sent.entries(i)) == [0, 1, 2]
    assert len(sent.msgs) == 2  # 3 x 256 KiB of states: two frames
    for c in conns:
        c.close()


# -- node summaries (setting node_summaries: agent/held_reports.py) ----------------------------
@pytest.fixture
def summarizing():
    sent = Sent()
    node = NodeRelay(SECRET, sent, delay_s=DELAY_S, summaries=True)
    node.held.summary_s = 0.0  # a summary at each look of the watcher, for the test
    node.start()
    yield node, sent
    node.close()


def _steady_steps(node: NodeRelay, conns, steps: range) -> None:
    for step in steps:
        for r, c in enumerate(conns):
            c.send(m.Progress(rank=r, attempt=0, step=step, phase="compute", metrics={"step_s": 0.01},
                              state=b"own%d-%d" % (r, step), done=True, synced=True))
    deadline = time.monotonic() + 5
    while not all(node.held._ranks.get(r) is not None and node.held._ranks[r].done == steps[-1]
                  for r in range(len(conns))):
        assert time.monotonic() < deadline, "the relay did not take the reports in"
        time.sleep(0.005)
    node.flush_due(time.monotonic() + DELAY_S)  # the batches of the reports not held: sent after the delay


def _relayed(sent: Sent) -> list[tuple[int, m.Message]]:
    return [(e.rank, e) for msg in sent.msgs if type(msg) is m.NodeReports
            for _, e in ((pid, m.decode(x)) for pid, x in zip(msg.pids, msg.entries))]


def test_steady_reports_are_held_and_the_node_sends_a_summary_instead(summarizing):
    node, sent = summarizing
    with _workers(node, 2) as conns:
        _steady_steps(node, conns, range(1, 11))
        relayed = _relayed(sent)
        assert sorted(e.step for _, e in relayed) == [1, 1, 2, 2, 3, 3]  # the first three of each, then held
        (summary,) = [msg for msg in sent.msgs if type(msg) is m.NodeSummary]
        assert (summary.nranks, summary.done, summary.step_s) == (2, 10, 0.01)


def test_a_pause_sends_every_held_report_first_with_its_age(summarizing):
    node, sent = summarizing
    with _workers(node, 2) as conns:
        _steady_steps(node, conns, range(1, 8))
        count = len(sent.msgs)
        time.sleep(0.05)
        conns[1].send(m.RankPaused(rank=1, attempt=0, gen=1, step=8, phase="compute"))
        sent.wait(count + 1)
        last = sent.msgs[-1]
        kinds = [(m.decode(x).TYPE, m.decode(x).rank) for x in last.entries]
        assert kinds[-1] == ("rank_paused", 1) and sorted(kinds[:-1]) == [("progress", 0)] * 3 + [("progress", 1)] * 3
        assert all(age >= 0.04 for age in last.ages[:-1]) and last.ages[-1] < 0.04  # held ones: sent late, told so
        states = {(m.decode(x).rank, m.decode(x).step): m.decode(x).state for x in last.entries[:-1]}
        assert states[(0, 7)] == b"own0-7" and states[(1, 5)] == b"own1-5"


def test_a_stalled_rank_makes_the_node_send_what_it_holds(summarizing):
    node, sent = summarizing
    with _workers(node, 2) as conns:
        _steady_steps(node, conns, range(1, 8))
        before = len(_relayed(sent))
        node.flush_due(time.monotonic() + 0.1)
        assert len(_relayed(sent)) == before  # not stalled yet
        node.flush_due(time.monotonic() + 5.0)  # nobody reported for 5 s: the controller's hang rule needs them
        assert len(_relayed(sent)) == before + 2 * 3


def test_a_dead_ranks_held_reports_go_before_its_exit(summarizing):
    node, sent = summarizing
    conns = [_worker(node, r) for r in range(2)]
    _connected(node, 2)
    _steady_steps(node, conns, range(1, 8))
    conns[1].close()
    node.rank_gone(1)
    assert (1, 7) in {(r, e.step) for r, e in _relayed(sent)}  # its own state at step 7's start: for its replacement
    assert 1 not in node.held._ranks
    conns[0].close()


# -- the worker's side ----------------------------------------------------------------------
class FakeController:
    """Accepts one worker connection; records its messages; can send it orders."""

    def __init__(self) -> None:
        self.got: queue.Queue = queue.Queue()
        self.conn = None
        self.ready = threading.Event()
        self.server = Server("127.0.0.1", 0, SECRET, self._serve)
        self.server.start()

    def _serve(self, conn) -> None:
        self.conn = conn
        self.ready.set()
        while True:
            self.got.put(conn.recv())


@pytest.fixture
def relayed(relay):
    """(node relay, its sent batches, a fake controller, a worker's ControlClient relayed through the node)."""
    node, sent = relay
    ctl = FakeController()
    client = ControlClient(f"127.0.0.1:{ctl.server.port}", SECRET.decode(), rank=0, pid=1000, attempt=0,
                           relay=node.address)
    try:
        yield node, sent, ctl, client
    finally:
        client.close()
        ctl.server.close()


def test_a_relayed_worker_registers_so_and_reports_through_its_agent(relayed):
    node, sent, ctl, client = relayed
    assert ctl.got.get(timeout=5) == m.RankRegister(rank=0, pid=1000, attempt=0, relay=True)
    client.progress(4, "compute")
    client.synced(0, 4)
    sent.wait(2)  # the compute report, then StepSynced: each a complete batch of this one-rank node
    assert [type(e).__name__ for i in range(2) for _, e in sent.entries(i)] == ["Progress", "StepSynced"]


def test_an_abort_carries_the_step_the_controller_recorded_committed(relayed):
    node, sent, ctl, client = relayed
    ctl.ready.wait(5)
    ctl.conn.send(m.Abort(gen=1, reason="rank 3 died", committed_step=4))  # step 4 recorded before the fault
    deadline = time.monotonic() + 5
    while client.abort_gen < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (client.abort_gen, client.committed_step) == (1, 4)  # a rank in the vote of step 4 updates it


def test_a_dead_agent_is_a_lost_controller(relayed):
    node, sent, ctl, client = relayed
    ctl.ready.wait(5)
    node.close()  # the agent is gone: its relay connections end
    deadline = time.monotonic() + 5
    while client.abort_gen != LOST_CONTROLLER_GEN and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.abort_gen == LOST_CONTROLLER_GEN
    assert "agent" in client.abort_reason
