"""The controller's handlers (message -> event) and executor (action -> message), with a fake
hub (the real board, watchdog and step handling) and fake connections: milliseconds, no sockets,
no processes."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from unbroken.config import LaunchConfig
from unbroken.controller import machine as sm
from unbroken.controller.board import Board
from unbroken.controller.connections import AGENT_HANDLERS, RANK_HANDLERS, Connections
from unbroken.controller.executor import Executor
from unbroken.controller.liveness import Liveness
from unbroken.controller.rank_state import RankStates
from unbroken.controller.server import Controller
from unbroken.controller.store_service import StoreService
from unbroken.controller.timing import RecoveryTiming
from unbroken.controller.views import RankView
from unbroken.controller.watchdog import Watchdog
from unbroken.names import Phase, WorkerState
from unbroken.protocol import messages as m
from unbroken.protocol.framing import unpack_payload
from unbroken.recovery.restore_point import RankOffer, RestorePoint

pytestmark = pytest.mark.timeout(10)


class FakeEvents:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def emit(self, name: str, **fields) -> None:
        self.lines.append((name, fields))

    def names(self) -> list[str]:
        return [n for n, _ in self.lines]


class FakeConn:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, msg) -> None:
        self.sent.append(msg)

    def send_packed(self, data: bytes) -> None:  # a frame encoded once for many connections
        self.sent.append(m.decode(unpack_payload(data[4:])))


class FakeStorage:
    def __init__(self, fail: bool = False) -> None:
        self.commits: list[int] = []
        self.fail = fail

    def commit(self, step, world_size, meta=None) -> None:
        if self.fail:
            raise OSError("disk full")
        self.commits.append(step)


class FakeLive:
    def __init__(self) -> None:
        self.steps: list[tuple] = []

    def on_step(self, rank, step, metrics) -> None:
        self.steps.append((rank, step, metrics))


class FakeHub:
    """The Hub the handlers and the executor use: the real board, watchdog, executor and the
    Controller's own step handling; `apply` records the events (and runs the machine if asked)."""

    def __init__(self, world_size: int = 2, *, run_machine: bool = False) -> None:
        self.cfg = LaunchConfig(script="x", nproc_per_node=world_size)
        self.host = "127.0.0.1"
        self.events = FakeEvents()
        self.lock = threading.RLock()
        self.state = sm.JobState(sm.JobPolicy(max_restarts=1), world_size=world_size)
        self.board = Board(world_size, nnodes=1)
        for r in range(world_size):  # every rank's process of attempt 0 started (pid 100 + rank)
            self.board.process_started(r, 100 + r, 0, now=0.0)
        self.storage = FakeStorage()
        self.timing = RecoveryTiming()
        self.watchdog = self._watchdog = Watchdog(self.cfg.hang, 0.0)
        self.liveness = Liveness(self.cfg.node_timeout_s)
        self.rank_states = RankStates(limit_bytes=1 << 16)
        self.connections = Connections(self)
        self.store_service = StoreService()
        self.live = FakeLive()
        self._step_listeners = [self.live.on_step]
        self.applied: list = []
        self.degraded_calls: list = []
        self.commits: list = []
        self._run_machine = run_machine
        self.executor = Executor(self)

    step_completed = Controller.step_completed  # the real one, over this hub's pieces

    def apply(self, event) -> None:
        self.applied.append(event)
        if self._run_machine:
            self.state, actions = sm.transition(self.state, event)
            self.executor.execute(actions)

    def reply(self, action) -> None:
        self.executor.execute([action])

    def degraded(self, rank, attempt, reason) -> None:
        self.degraded_calls.append((rank, attempt, reason))

    def step_committed(self, gen, step) -> None:  # the commit log's entry (--controller-store)
        self.commits.append((gen, step))

    def check_recovered(self) -> None:
        pass

    def refused(self, node_rank, standby) -> str:
        return ""

    def connect(self, rank: int, conn, *, relayed: bool = False, phase: str | None = None) -> None:
        """Rank ``rank``'s worker registered on ``conn`` (and, with ``phase``, reported it)."""
        self.board.connected(rank, conn, relayed=relayed)
        if phase is not None:
            self.board.reported(rank, phase, in_loop=True)

    def agent(self, node: int, conn) -> None:
        self.board.agent_joined(node, conn, standby=False)


def worker_msg(hub, rank, msg, conn=None):
    RANK_HANDLERS[type(msg)](hub.connections, rank, 0, conn or FakeConn(), msg)


def test_a_message_that_is_its_own_event_gets_the_connections_rank_and_attempt():
    hub = FakeHub()
    worker_msg(hub, 1, m.StepSynced(rank=0, attempt=7, gen=0, step=5))  # a wrong rank in the body
    assert hub.applied == [sm.StepSynced(1, 0, 0, 5)]


def test_progress_done_moves_the_view_and_times_the_step():
    hub = FakeHub()
    worker_msg(hub, 0, m.Progress(rank=0, attempt=0, step=0, phase="compute", metrics={}))
    worker_msg(hub, 0, m.Progress(rank=0, attempt=0, step=0, phase="sync", metrics={}))
    assert len(hub.board.view(0).compute_s) == 0  # the rank measures its compute time and sends it with 'done'
    done = {"loss": 2.0, "compute_s": 0.25}
    worker_msg(hub, 0, m.Progress(rank=0, attempt=0, step=1, phase="done", metrics=done))
    w = hub.board.view(0)
    assert (w.step, w.steps_in_generation, w.metrics, w.phase) == (1, 1, done, Phase.DONE)
    assert hub.live.steps == [(0, 1, done)] and list(w.compute_s) == [0.25]
    worker_msg(hub, 0, m.Progress(rank=0, attempt=0, step=1, phase="finished", metrics={}))
    assert w.state == WorkerState.FINISHING and hub.applied == [sm.LoopFinished(0, 0)]  # the machine learns it


def test_a_compute_report_with_the_previous_steps_done_folded_in_counts_both():
    hub = FakeHub()
    worker_msg(hub, 0, m.Progress(rank=0, attempt=0, step=0, phase="compute", metrics={}))
    worker_msg(hub, 0, m.Progress(rank=0, attempt=0, step=1, phase="compute", metrics={"loss": 1.5},
                                  state=b"s1", done=True))
    w = hub.board.view(0)
    assert (w.step, w.steps_in_generation, w.metrics, w.phase, w.in_step_loop) == (1, 1, {"loss": 1.5}, Phase.COMPUTE,
                                                                               True)
    assert hub.live.steps == [(0, 1, {"loss": 1.5})]
    assert hub.rank_states.for_resume(0, 0, 1).state == b"s1"  # the step-start state of step 1 is kept


def test_step_synced_puts_the_rank_in_the_vote_and_the_commit_record_sends_nothing():
    hub = FakeHub(run_machine=True)
    hub.state = dataclasses.replace(hub.state, phase=sm.JobPhase.RUNNING)
    conns = {r: FakeConn() for r in hub.board.ranks()}
    for r in hub.board.ranks():
        hub.connect(r, conns[r], phase=Phase.COMPUTE)  # no 'sync' report came
    worker_msg(hub, 0, m.StepSynced(rank=0, attempt=0, gen=0, step=3))
    assert (hub.board.view(0).phase, hub.board.view(1).phase) == (Phase.VOTE, Phase.COMPUTE)  # rank 1: still computing
    worker_msg(hub, 1, m.StepSynced(rank=1, attempt=0, gen=0, step=3))
    assert {w.phase for w in hub.board.views()} == {Phase.VOTE}  # until each reports its next step
    assert all(c.sent == [] for c in conns.values())  # the record only: the ranks commit by their own vote
    assert hub.commits == [(0, 3)]  # the commit log's entry, once
    assert hub.board.counts.received["StepSynced"] == 0  # counted by the serving loop, not the handlers
    assert hub.board.counts.sent["CommitStep"] == 0


def test_a_death_after_the_loop_is_no_fault_to_time():
    hub = FakeHub()
    worker_msg(hub, 1, m.Progress(rank=1, attempt=0, step=9, phase="finished", metrics={}))
    AGENT_HANDLERS[m.RankExited](hub.connections, 0, m.RankExited(rank=1, pid=101, attempt=0, exit_code=None,
                                                                       signal=9, last_lines=[]))
    assert hub.applied[-1] == sm.RankExited(1, 0, None, 9, None, ()) and hub.timing.fault_t is None


def test_a_worker_exit_becomes_rank_exited_with_the_step_the_controller_saw():
    hub = FakeHub()
    hub.board.view(1).step = 9
    AGENT_HANDLERS[m.RankExited](hub.connections, 0, m.RankExited(rank=1, pid=101, attempt=0, exit_code=None,
                                                                       signal=9, last_lines=["boom"]))
    assert hub.applied == [sm.RankExited(1, 0, None, 9, 9, ("boom",))]
    assert hub.board.view(1).state == WorkerState.FAILED and hub.timing.fault_t is not None
    AGENT_HANDLERS[m.RankExited](hub.connections, 0, m.RankExited(rank=0, pid=100, attempt=5, exit_code=0,
                                                                       signal=None, last_lines=[]))
    assert len(hub.applied) == 1  # another attempt's exit is ignored


def test_a_restore_offer_on_another_ranks_connection_is_ignored():
    hub = FakeHub()
    worker_msg(hub, 0, m.RestoreOffer(rank=1, attempt=0, round=0, memory_steps=[3], storage_steps=[]))
    assert hub.applied == []
    worker_msg(hub, 0, m.RestoreOffer(rank=0, attempt=0, round=0, memory_steps=[3], storage_steps=[]))
    assert hub.applied == [sm.RestoreOffered(0, 0, 0, RankOffer.of([3], []))]


def test_a_fault_claim_is_granted_once():
    hub, conn = FakeHub(), FakeConn()
    worker_msg(hub, 0, m.ClaimFault(rank=0, fault_id="f1"), conn)
    worker_msg(hub, 1, m.ClaimFault(rank=1, fault_id="f1"), conn)
    assert [c.granted for c in conn.sent] == [True, False] and hub.events.names() == ["fault_injected"]


def test_restore_rounds_decide_once_every_rank_offered_and_answer_a_repeat():
    hub = FakeHub(run_machine=True)
    conns = {r: FakeConn() for r in range(2)}
    for r, conn in conns.items():
        hub.connect(r, conn)
    worker_msg(hub, 0, m.RestoreOffer(rank=0, attempt=0, round=0, memory_steps=[4, 2], storage_steps=[]), conns[0])
    assert all(not c.sent for c in conns.values())
    worker_msg(hub, 1, m.RestoreOffer(rank=1, attempt=0, round=0, memory_steps=[2], storage_steps=[4]), conns[1])
    assert [c.sent for c in conns.values()] == [[m.RestoreAt(attempt=0, round=0, step=4)]] * 2
    worker_msg(hub, 1, m.RestoreOffer(rank=1, attempt=0, round=0, memory_steps=[2], storage_steps=[4]), conns[1])
    assert conns[1].sent[-1] == m.RestoreAt(attempt=0, round=0, step=4) and len(conns[0].sent) == 1
    assert hub.events.names() == ["restore_decided"]


def test_a_step_persisted_by_every_rank_commits_and_supersedes_older_ones():
    hub = FakeHub(run_machine=True)
    AGENT_HANDLERS[m.Persisted](hub.connections, 0, m.Persisted(step=10, ranks=[0], seconds=0.5))
    AGENT_HANDLERS[m.Persisted](hub.connections, 0, m.Persisted(step=20, ranks=[0, 1], seconds=0.5))
    assert hub.storage.commits == [20] and hub.state.persisted == ()
    AGENT_HANDLERS[m.Persisted](hub.connections, 0, m.Persisted(step=30, ranks=[0], seconds=0.1, error="EIO"))
    assert hub.state.persisted == () and hub.events.names() == ["checkpoint_persisted", "persist_failed"]
    hub.storage.fail = True
    AGENT_HANDLERS[m.Persisted](hub.connections, 0, m.Persisted(step=40, ranks=[0, 1], seconds=0.1))
    assert hub.events.lines[-1] == ("persist_failed", {"step": 40, "error": "disk full"})


def test_the_executor_turns_actions_into_the_messages_agents_and_workers_get():
    hub = FakeHub()
    agent, worker = FakeConn(), FakeConn()
    hub.agent(0, agent)
    hub.connect(0, worker)
    for r in (0, 1):  # both ranks' own states at the start of step 3 (each sent: no `same` yet)
        RANK_HANDLERS[m.Progress](hub.connections, r, 0, worker, m.Progress(
            rank=r, attempt=0, step=3, phase="compute", metrics={}, state=b"start-3-%d" % r))
    hub.executor.execute([sm.KillRank(1, "hung"), sm.CommitStep(gen=0, step=3),
                          sm.OrderRegroup(2, 3, frozenset({1, 0})), sm.AbortGeneration(2, "lost rank 1")])
    assert agent.sent == [m.KillRank(rank=1, pid=101, reason="hung")]
    assert worker.sent == [m.Regroup(gen=2, resume_step=3, replaced=[0, 1], rank_state=b"start-3-0"),
                           m.Abort(gen=2, reason="lost rank 1")]
    assert hub.board.recovery_deadline[0] == 2
    assert hub.events.names() == ["kill_rank", "regroup", "per_rank_state", "per_rank_state", "abort_generation"]


def _three_ranks() -> tuple[FakeHub, dict[int, FakeConn]]:
    hub = FakeHub(world_size=3)
    conns = {r: FakeConn() for r in range(3)}
    for r, conn in conns.items():
        hub.connect(r, conn)
    return hub, conns


def _report(hub: FakeHub, conns: dict, rank: int, step: int, start: bytes | None, after: bytes | None) -> None:
    """Rank ``rank``'s reports of ``step``: the start (compute report) and the state after compute (StepSynced)."""
    if start is not None:
        RANK_HANDLERS[m.Progress](hub.connections, rank, 0, conns[rank], m.Progress(
            rank=rank, attempt=0, step=step, phase="compute", metrics={}, state=start))
    if after is not None:
        RANK_HANDLERS[m.StepSynced](hub.connections, rank, 0, conns[rank], m.StepSynced(
            rank=rank, attempt=0, gen=0, step=step, state=after))


def test_a_replaced_rank_gets_its_own_per_rank_state_in_its_regroup_order():
    hub, conns = _three_ranks()
    _report(hub, conns, 1, 3, b"start-3", b"after-3")  # the start of step 3, then the state after computing it
    for r in (0, 2):  # ranks 0 and 2 hold the same per-rank state (same seeds, same positions)
        _report(hub, conns, r, 3, b"same-start-3", None)
    assert hub.applied[-1] == m.StepSynced(rank=1, attempt=0, gen=0, step=3)  # the machine never sees the bytes
    hub.executor.execute([sm.OrderRegroup(2, 4, frozenset({1, 2}))])  # rolled forward: step 3 committed
    base = m.Regroup(gen=2, resume_step=4, replaced=[1, 2], fallback=[2])
    assert conns[0].sent == [base]
    assert conns[1].sent == [dataclasses.replace(base, rank_state=b"after-3")]
    assert conns[2].sent == [base]  # rank 2 has no state for step 4: rank 0's copy, known to equal its own
    sources = {f["rank"]: f["source"] for n, f in hub.events.lines if n == "per_rank_state"}
    assert sources[1] == "after compute of step 3"
    assert sources[2] == "fallback: rank 0's copy (equal to rank 2's at the start of step 3)"


def test_a_survivors_copy_that_is_not_known_to_equal_the_lost_ranks_state_is_refused_not_sent():
    """Per-rank seeds, data positions: another rank's copy is exact only where the two were seen equal."""
    hub, conns = _three_ranks()
    _report(hub, conns, 0, 3, b"rank-0-start-3", None)
    _report(hub, conns, 2, 3, b"rank-2-start-3", None)
    hub.executor.execute([sm.OrderRegroup(2, 4, frozenset({2}))])
    assert all(c.sent == [] for c in conns.values()) and "per_rank_state" not in hub.events.names()
    (refused,) = [e for e in hub.applied if isinstance(e, sm.RegroupRefused)]
    assert refused.gen == 2 and "rank 2's own state for step 4 never reached the controller" in refused.why


def test_once_a_rank_state_moves_after_its_update_the_state_after_compute_is_no_resume_point():
    """A draw after opt.step(): the start of k + 1 differs from the state after computing k, so that state is not
    what a rank lost in its update would have resumed with; refused (a checkpoint restart), not handed out."""
    hub, conns = _three_ranks()
    _report(hub, conns, 1, 3, b"start-3", b"after-3")
    _report(hub, conns, 0, 3, b"r0-start-3", b"r0-after-3")
    hub.executor.execute([sm.OrderRegroup(2, 4, frozenset({1}))])  # nothing says rank 1's state moves
    assert conns[1].sent[-1].rank_state == b"after-3"
    _report(hub, conns, 0, 4, b"r0-start-4", None)  # rank 0 drew after its update of step 3
    assert hub.rank_states.moved_after_update == (0, 3)
    hub.executor.execute([sm.OrderRegroup(3, 4, frozenset({1}))])
    (refused,) = [e for e in hub.applied if isinstance(e, sm.RegroupRefused)]
    assert "rank 0's own state moved after its update of step 3" in refused.why
    _report(hub, conns, 1, 4, b"start-4", None)  # its own start of step 4 is exact, whatever moved before it
    hub.executor.execute([sm.OrderRegroup(4, 4, frozenset({1}))])
    assert conns[1].sent[-1].rank_state == b"start-4"


def test_a_replacements_first_report_is_not_taken_for_a_move_after_the_update():
    hub, conns = _three_ranks()
    _report(hub, conns, 1, 3, b"start-3", b"after-3")
    hub.rank_states.process_started(1)  # its replacement loads "after-3"; its encoding may differ
    _report(hub, conns, 1, 4, b"after-3, encoded anew", None)
    _report(hub, conns, 1, 4, None, b"after-4")
    RANK_HANDLERS[m.Progress](hub.connections, 1, 0, conns[1], m.Progress(
        rank=1, attempt=0, step=5, phase="compute", metrics={}, state_same=True))
    assert hub.rank_states.moved_after_update is None


def test_a_roll_forward_on_a_vote_without_the_replaced_ranks_own_state_is_refused_not_sent():
    """Rolled forward on a survivor's vote, a replaced rank whose state after that compute never reached the
    controller would get another rank's copy (not exact): the executor sends nothing and refuses."""
    hub, conns = _three_ranks()
    RANK_HANDLERS[m.StepSynced](hub.connections, 1, 0, conns[1], m.StepSynced(
        rank=1, attempt=0, gen=0, step=3, state=b"after-3"))
    hub.executor.execute([sm.OrderRegroup(2, 4, frozenset({2}), voted=True)])
    assert all(c.sent == [] for c in conns.values())
    (refused,) = [e for e in hub.applied if isinstance(e, sm.RegroupRefused)]
    assert refused.gen == 2 and "rank 2's own state for step 4" in refused.why
    hub.executor.execute([sm.OrderRegroup(3, 4, frozenset({1}), voted=True)])  # rank 1's own state is kept
    assert conns[0].sent == [m.Regroup(gen=3, resume_step=4, replaced=[1])]
    assert conns[1].sent == [m.Regroup(gen=3, resume_step=4, replaced=[1], rank_state=b"after-3")]


def test_a_dump_at_a_voted_step_without_a_lost_ranks_own_state_is_refused_not_written():
    hub, conns = _three_ranks()
    hub.executor.execute([sm.DumpOrder(2, 4, ((2, 0),), voted=True)])
    assert all(c.sent == [] for c in conns.values()) and "dump" not in hub.events.names()
    (refused,) = [e for e in hub.applied if isinstance(e, sm.RegroupRefused)]
    assert refused.gen == 2 and "no exact dump at step 4: rank 2's own state" in refused.why
    _report(hub, conns, 2, 3, b"start-3", None)
    _report(hub, conns, 0, 3, b"start-3", None)  # rank 0's per-rank state is rank 2's: its file holds it
    hub.executor.execute([sm.DumpOrder(3, 4, ((2, 0),))])
    assert "dump" in hub.events.names()


def test_the_executor_finishes_the_job_and_tells_every_agent():
    hub = FakeHub()
    agents = {0: FakeConn(), 1: FakeConn()}
    for node, conn in agents.items():
        hub.agent(node, conn)
    point = RestorePoint(step=-1, tiers=(), reason="nothing")
    hub.executor.execute([sm.RestoreDecided(0, 0, point, None), sm.Finish(0, "done")])
    assert hub.board.outcome.exit_code == 0 and hub.board.is_done()
    assert all(c.sent == [m.Shutdown(exit_code=0, reason="done")] for c in agents.values())


def test_recovery_timing_reports_the_in_flight_milestones():
    timing = RecoveryTiming()
    views = [RankView(rank=0, step=7), RankView(rank=1, step=6)]
    timing.fault_began(10.0, views)
    timing.fault_began(11.0, views)  # the first fault of a cascade counts
    timing.decided(10.5)
    timing.mark("joined", 10.6, first=True)
    timing.mark("joined", 10.9, first=True)
    timing.mark("regroup", 10.7)
    timing.resumed(0.2)
    fields = timing.recovered_in_flight(resume_step=6, now=11.0)
    assert fields == dict(detect_s=0.5, replace_s=0.1, regroup_s=0.1, restore_s=0.2, total_s=1.0, steps_redone=1)
    assert timing.check_recovered(views, 0, 12.0) is None  # rank 1 is not back at step 7 yet
    views[1].step = 7
    name, fields = timing.check_recovered(views, 0, 12.0)
    assert name == "recovered" and fields["tier"] == "replicas"
    assert timing.check_recovered(views, 0, 12.0) is None  # reported once


def test_an_agents_process_status_reaches_the_view_only_for_the_current_process():
    hub = FakeHub()
    AGENT_HANDLERS[m.RankStatus](hub.connections, 0, m.RankStatus(rank=1, pid=101, attempt=0, status="stopped"))
    AGENT_HANDLERS[m.RankStatus](hub.connections, 0, m.RankStatus(rank=0, pid=999, attempt=0, status="zombie"))
    assert (hub.board.view(1).process, hub.board.view(0).process) == ("stopped", "running")
    assert hub.events.lines == [("rank_status", {"rank": 1, "pid": 101, "status": "stopped"})]
    AGENT_HANDLERS[m.RankStarted](hub.connections, 0, m.RankStarted(rank=1, pid=102, attempt=0))
    assert hub.board.view(1).process == "running"  # a new process of the rank starts running


def test_the_watchdog_blames_the_rank_that_never_reached_the_collective():
    hub = FakeHub(world_size=3)
    for w in hub.board.views():
        w.state, w.phase, w.last_progress_t, w.in_step_loop = WorkerState.RUNNING, Phase.SYNC, 0.0, True
    hub.board.view(2).phase, hub.board.view(2).last_progress_t = Phase.COMPUTE, 1.0  # silent for less time
    timeout_s = hub.cfg.hang.first_step_timeout_s
    assert hub.watchdog.find_hung(hub.board.views(), 0, now=timeout_s) is None
    blamed, why = hub.watchdog.find_hung(hub.board.views(), 0, now=timeout_s + 0.5)
    assert blamed.rank == 2 and "never reached the collective (phase compute)" in why


def test_the_watchdog_finds_a_survivor_silent_since_the_abort_order():
    hub = FakeHub(world_size=3)
    for w in hub.board.views():
        w.state = WorkerState.RUNNING
    rec = sm.Recovery("recover-in-place", 1, frozenset({2}), 1, paused=frozenset({0}))
    timeout_s = hub.cfg.hang.first_step_timeout_s
    find = hub.watchdog.find_silent_in_recovery
    assert find(hub.board.views(), 0, rec, ordered_t=10.0, now=10.0 + timeout_s) is None
    assert find(hub.board.views(), 0, rec, ordered_t=10.0, now=10.5 + timeout_s).rank == 1


def test_every_attempt_gets_a_fresh_store_key_prefix_handed_out_over_the_control_plane():
    hub = FakeHub()
    agent = FakeConn()
    hub.agent(0, agent)
    try:
        hub.executor.execute([sm.StartAttempt(0), sm.RestartRanks(frozenset({1}), 1, 0)])
        start, restart = agent.sent
        assert start.store_prefix.startswith("rdzv-") and restart.store_prefix == start.store_prefix
        set_key = m.StoreRequest(id=1, op="set", keys=["k"], values=[b"v"])
        assert hub.store_service.handle(agent, 0, set_key)[0][1].ok  # attempt 0's table is open
        hub.executor.execute([sm.StartAttempt(1)])
        assert agent.sent[-1].store_prefix not in ("", start.store_prefix)
        (_, refused), = hub.store_service.handle(agent, 0, set_key)  # the older attempt's table is gone
        assert not refused.ok and "attempt 0 is over" in refused.error
        assert hub.store_service.keys_of(1) == {}
    finally:
        hub.executor.close()


def test_a_job_finishes_once_the_first_outcome_wins():
    hub = FakeHub()
    hub.executor.execute([sm.Finish(143, "terminated: SIGTERM"), sm.Finish(143, "a second SIGTERM")])
    assert hub.events.names().count("job_finished") == 1
    assert hub.board.outcome.reason == "terminated: SIGTERM"


def test_what_the_script_imported_goes_to_every_agent_once_checked():
    hub = FakeHub()
    agents = {0: FakeConn(), 1: FakeConn()}
    for node, conn in agents.items():
        hub.agent(node, conn)
    modules = ["numpy", "torch.distributed.fsdp", "os; rm -rf /", 7]
    worker_msg(hub, 0, m.RankEvent(rank=0, attempt=0, name="script_imports", fields={"modules": modules}))
    worker_msg(hub, 1, m.RankEvent(rank=1, attempt=0, name="script_imports", fields={"modules": ["other"]}))
    for conn in agents.values():  # the first report only, names only
        assert conn.sent == [m.SpareImports(modules=["numpy", "torch.distributed.fsdp"])]
    assert hub.events.lines == [("script_imports", {"count": 2, "modules": ["numpy", "torch.distributed.fsdp"]})]


# -- per-node aggregation (agent/relay.py): the controller's side ------------------------------
def _relayed_hub(world_size: int = 4) -> tuple[FakeHub, dict[int, FakeConn], FakeConn]:
    """A running job on one node whose agent relays for ranks 1..N-1; rank 0 reports directly."""
    hub = FakeHub(world_size, run_machine=True)
    hub.state = dataclasses.replace(hub.state, phase=sm.JobPhase.RUNNING)
    conns = {r: FakeConn() for r in hub.board.ranks()}
    for r in hub.board.ranks():
        hub.connect(r, conns[r], relayed=r > 0, phase=Phase.COMPUTE)
    agent = FakeConn()
    hub.agent(0, agent)
    return hub, conns, agent


def _node_reports(hub, msgs, pids=None) -> None:
    pids = pids or [100 + msg.rank for msg in msgs]
    AGENT_HANDLERS[m.NodeReports](hub.connections, 0, m.NodeReports(entries=[m.encode(x) for x in msgs], pids=pids))


def test_a_nodes_reports_count_for_each_of_its_ranks_and_the_commit_is_recorded_once_all_reported():
    hub, conns, agent = _relayed_hub()
    _node_reports(hub, [m.Progress(rank=r, attempt=0, step=3, phase="compute", metrics={}, state=b"s%d" % r)
                        for r in (1, 2, 3)])
    assert hub.rank_states.for_resume(2, 0, 3).state == b"s2"  # each rank's step-start state is kept
    _node_reports(hub, [m.StepSynced(rank=r, attempt=0, gen=0, step=3) for r in (1, 2, 3)])
    assert agent.sent == [] and hub.state.committed_step == -1  # rank 0 has not reported: no commit
    worker_msg(hub, 0, m.StepSynced(rank=0, attempt=0, gen=0, step=3))
    assert hub.state.committed_step == 3 and {w.phase for w in hub.board.views()} == {Phase.VOTE}
    assert agent.sent == [] and all(c.sent == [] for c in conns.values())  # the ranks commit by their own vote
    counts = hub.board.counts
    assert (counts.received["NodeReports"], counts.sent["CommitStep"]) == (2, 0)
    assert (counts.relayed["Progress"], counts.relayed["StepSynced"]) == (3, 3)


def test_a_missing_rank_in_the_nodes_reports_holds_the_commit():
    hub, conns, agent = _relayed_hub()
    worker_msg(hub, 0, m.StepSynced(rank=0, attempt=0, gen=0, step=1))
    _node_reports(hub, [m.StepSynced(rank=r, attempt=0, gen=0, step=1) for r in (1, 3)])
    assert hub.state.committed_step == -1 and agent.sent == []
    assert [hub.board.view(r).phase for r in range(4)] == [Phase.VOTE, Phase.VOTE, Phase.COMPUTE, Phase.VOTE]
    _node_reports(hub, [m.StepSynced(rank=2, attempt=0, gen=0, step=1)])
    assert hub.state.committed_step == 1 and agent.sent == []


def test_a_run_of_relayed_step_synced_is_one_transition_in_the_batch_order():
    """Consecutive StepSynced of one step in a node's batch go through the machine as one
    RanksSynced; any other report ends the run, so the batch's order is kept."""
    hub, conns, agent = _relayed_hub()
    worker_msg(hub, 0, m.StepSynced(rank=0, attempt=0, gen=0, step=1))
    _node_reports(hub, [m.StepSynced(rank=1, attempt=0, gen=0, step=1), m.StepSynced(rank=2, attempt=0, gen=0, step=1),
                        m.RankPaused(rank=1, attempt=0, gen=0, step=1, phase="sync"),
                        m.StepSynced(rank=3, attempt=0, gen=0, step=1)])
    assert [type(e).__name__ for e in hub.applied] == ["StepSynced", "RanksSynced", "RankPaused", "RanksSynced"]
    assert (hub.applied[1].ranks, hub.applied[3].ranks) == ({1, 2}, {3})
    assert hub.state.committed_step == 1 and agent.sent == []
    assert hub.board.counts.relayed["StepSynced"] == 3


def test_a_commit_told_by_compute_reports_is_recorded_in_one_transition_per_step():
    """A step committed without a vote and without commit reports (worker/commit.py): each rank's next
    compute report says so (Progress.synced), directly or in its node's batch (one RanksSynced per step,
    before any other report of the batch); the ranks' own state after compute did not travel."""
    hub, conns, agent = _relayed_hub()

    def told(r):
        return m.Progress(rank=r, attempt=0, step=4, phase="compute", metrics={}, state=b"s%d" % r, done=True,
                          synced=True)
    worker_msg(hub, 0, told(0))
    _node_reports(hub, [told(1), told(2), m.RankPaused(rank=1, attempt=0, gen=0, step=4, phase="sync"), told(3)])
    assert [type(e).__name__ for e in hub.applied] == ["StepSynced", "RanksSynced", "RankPaused", "RanksSynced"]
    assert (hub.applied[1].ranks, hub.applied[1].step, hub.applied[3].ranks) == ({1, 2}, 3, {3})
    assert hub.state.committed_step == 3 and agent.sent == []
    assert [hub.board.view(r).phase for r in range(4)] == [Phase.COMPUTE] * 4  # in step 4, not waiting in a vote
    assert hub.rank_states.for_resume(2, 0, 4).state == b"s2"


def test_relayed_reports_of_another_process_attempt_or_node_are_fenced():
    hub, conns, agent = _relayed_hub(2)
    _node_reports(hub, [m.StepSynced(rank=1, attempt=0, gen=0, step=1)], pids=[999])  # an old process of rank 1
    _node_reports(hub, [m.StepSynced(rank=1, attempt=3, gen=0, step=1)])  # another attempt's
    AGENT_HANDLERS[m.NodeReports](hub.connections, 0, m.NodeReports(
        entries=[m.encode(m.ClaimFault(rank=1, fault_id="f")), {"type": "bogus"}], pids=[101, 101]))
    assert hub.applied == [] and hub.board.counts.relayed == {}


def test_an_abort_order_carries_the_committed_step():
    hub, conns, agent = _relayed_hub(2)
    hub.state = dataclasses.replace(hub.state, committed_step=6)
    hub.executor.execute([sm.AbortGeneration(1, "rank 1 died")])
    assert conns[0].sent == [m.Abort(gen=1, reason="rank 1 died", committed_step=6)]


def test_the_redo_step_after_an_in_flight_recovery_gets_the_first_step_timeout_on_every_rank():
    """Survivors wait in the redo step's first collective for the replacement's first step: they must not
    be blamed as hung at the calibrated timeout while the replacement is within its first-step allowance."""
    hub = FakeHub(world_size=3)
    hang = hub.cfg.hang
    for w in hub.board.views():
        w.steps_in_generation = 7
    calibrated = hub.watchdog.hang_timeout_s(hub.board.view(0))
    assert calibrated == hang.floor_s < hang.first_step_timeout_s
    hub.executor.execute([sm.Recovered(gen=1, resume_step=7, replaced=frozenset({2}))])
    assert [hub.watchdog.hang_timeout_s(w) for w in hub.board.views()] == [hang.first_step_timeout_s] * 3
    worker_msg(hub, 0, m.Progress(rank=0, attempt=0, step=8, phase="done", metrics={}))  # the redo step done
    assert hub.watchdog.hang_timeout_s(hub.board.view(0)) == calibrated
    assert hub.watchdog.median_step_s() is None  # the redo step is not a steady step: not in the median
