"""The controller's control connections: agents and workers in, events to the state machine out.

One thread per connection (the protocol server's) runs :meth:`Connections.serve`. A message is
fenced (an older attempt's, or a process the rank no longer is, counts for nothing), then looked
up in a message-type -> handler table; a handler notes what it says on the controller's
:class:`~unbroken.controller.board.Board`, logs it, and turns it into an event of the pure state
machine (``Hub.apply``), all under the controller's lock. Nothing is sent from here: what must
answer a message directly (a fault claim, an agent that does not fit) goes to the executor as a
:class:`~unbroken.controller.hub.Reply` (``Hub.reply``).
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
from collections.abc import Callable
from typing import Any

from unbroken.controller import machine as sm
from unbroken.controller.hub import Hub, Reply, TellAgents
from unbroken.controller.rank_state import Point
from unbroken.controller.summaries import sane_age
from unbroken.controller.values import RankSet
from unbroken.errors import ConnectionClosed, ProtocolError
from unbroken.names import SCRIPT_IMPORTS_EVENT, STEP_PHASES, Phase
from unbroken.protocol import messages as m
from unbroken.protocol.wire import Connection
from unbroken.recovery.restore_point import RankOffer


log = logging.getLogger(__name__)

AgentHandler = Callable[["Connections", int, Any], None]
RankHandler = Callable[["Connections", int, int, Connection, Any], None]


class Connections:
    """Serves every control connection (see the module docstring); holds no state of its own."""

    def __init__(self, hub: Hub) -> None:
        self._hub = hub

    # -- serving -------------------------------------------------------------------------
    def serve(self, conn: Connection) -> None:
        try:
            if conn.role == "agent":
                self._serve_agent(conn)
            elif conn.role == "worker":
                self._serve_worker(conn)
            elif conn.role == "store":  # a worker's rendezvous store: not under the controller's lock
                self._hub.store_service.serve(conn)
            else:
                raise ProtocolError(f"unknown role {conn.role!r} from {conn.peer} (allowed: agent, worker, store)")
        except ConnectionClosed:
            pass
        finally:
            conn.close()

    def _serve_agent(self, conn: Connection) -> None:
        hub, cfg = self._hub, self._hub.cfg
        first = conn.recv(timeout_s=10.0)
        if not isinstance(first, m.AgentRegister):
            raise ProtocolError(f"agent {conn.peer} must register first, sent {type(first).__name__}")
        node = first.node_rank
        with hub.lock:
            if not first.standby and (not 0 <= node < cfg.nnodes or first.nproc != cfg.nproc_per_node):
                hub.reply(Reply(conn, m.Shutdown(exit_code=2, reason=(
                    f"agent of node {node} with --nproc-per-node {first.nproc} does not fit this job "
                    f"(--nnodes {cfg.nnodes}, --nproc-per-node {cfg.nproc_per_node})"))))
                return
            refused = hub.refused(node, first.standby)
            if refused:  # a node lost with the previous controller (controller/takeover.py)
                hub.events.emit("agent_refused", node_rank=node, host=first.host, pid=first.pid, reason=refused)
                hub.reply(Reply(conn, m.Shutdown(exit_code=1, reason=refused)))
                return
            agent = hub.board.agent_joined(node, conn, standby=first.standby)
            hub.liveness.heard(agent, time.monotonic())
            if first.standby:  # spares get ids after the nodes
                hub.events.emit("standby_joined", agent=agent, host=first.host, pid=first.pid)
                event: sm.Event = sm.StandbyJoined(agent)
            else:
                hub.events.emit("agent_joined", node_rank=node, host=first.host, pid=first.pid)
                event = sm.AgentJoined(node)
            hub.apply(event)
            if hub.board.spare_imports is not None:
                hub.reply(TellAgents(m.SpareImports(modules=hub.board.spare_imports), agent))
        try:
            while True:
                msg = conn.recv()
                with hub.lock:
                    if hub.board.agent_conn(agent) is conn:
                        hub.liveness.heard(agent, time.monotonic())
                    handler = AGENT_HANDLERS.get(type(msg))
                    if handler is None:
                        log.warning("controller: unexpected %s from an agent", type(msg).__name__)
                    else:
                        handler(self, agent, msg)
        except ConnectionClosed:
            with hub.lock:
                if hub.board.agent_left(agent, conn):
                    hub.liveness.forget(agent)
                    hub.summaries.forget(agent)
                    if not hub.board.is_done():
                        hub.events.emit("agent_lost", node_rank=agent)
                        hub.timing.fault_began(time.monotonic(), hub.board.views())  # ('recovered' times it)
                        self._close_workers_of(agent)
                        hub.apply(sm.AgentLost(agent, hub.board.last_steps()))
            raise

    def _close_workers_of(self, agent: int) -> None:
        """The control connections of the ranks a lost agent hosted: a frozen or cut-off worker that
        comes back finds them closed and leaves; nothing it sends counts any more (fencing)."""
        hub = self._hub
        for w in hub.board.views():
            if w.conn is not None and hub.state.agent_of(w.rank) == agent:
                w.conn.close()

    def _serve_worker(self, conn: Connection) -> None:
        hub = self._hub
        first = conn.recv(timeout_s=10.0)
        if not isinstance(first, m.RankRegister) or not 0 <= first.rank < hub.cfg.world_size:
            raise ProtocolError(f"worker {conn.peer} must register with a rank in [0, {hub.cfg.world_size})")
        with hub.lock:
            w = hub.board.view(first.rank)
            # Fencing: a process of an older attempt, or one that is not the agent's current
            # process for this rank, never joins.
            if first.attempt != hub.state.attempt or (w.pid and first.pid != w.pid):
                hub.events.emit("rank_fenced", rank=first.rank, pid=first.pid, attempt=first.attempt)
                return
            hub.board.connected(first.rank, conn, relayed=first.relay)
            if first.replacement:
                self._replacement_joined(first.rank, first.gen)
        while True:
            msg = conn.recv()
            with hub.lock:
                hub.board.count_received(type(msg).__name__)
                if first.attempt != hub.state.attempt or hub.board.view(first.rank).conn is not conn:
                    continue  # an older attempt's, or a process this rank no longer is
                handler = RANK_HANDLERS.get(type(msg))
                if handler is not None:
                    handler(self, first.rank, first.attempt, conn, msg)

    def _replacement_joined(self, rank: int, gen: int) -> None:
        hub = self._hub
        hub.timing.mark("joined", time.monotonic(), first=True)
        hub.events.emit("replacement_joined", rank=rank, gen=gen, attempt=hub.state.attempt)
        hub.apply(sm.ReplacementJoined(rank, hub.state.attempt, gen))

    def _script_imports(self, modules: object) -> None:
        """The first report of what the script imported goes to every agent (for its warm spares)
        and to each agent that registers later; later reports change nothing."""
        names = self._hub.board.script_imported(modules)
        if names is None:
            return
        self._hub.events.emit(SCRIPT_IMPORTS_EVENT, count=len(names), modules=names)
        self._hub.reply(TellAgents(m.SpareImports(modules=names)))


# -- agent messages ------------------------------------------------------------------------
def _rank_started(self: Connections, agent: int, msg: m.RankStarted) -> None:
    self._hub.board.process_started(msg.rank, msg.pid, msg.attempt, time.monotonic(), agent=agent)
    self._hub.rank_states.process_started(msg.rank)
    self._hub.events.emit("rank_started", rank=msg.rank, pid=msg.pid, attempt=msg.attempt, how=msg.how)


def _rank_exited(self: Connections, agent: int, msg: m.RankExited) -> None:
    hub = self._hub
    if msg.attempt != hub.state.attempt:
        return
    after_loop = hub.board.process_exited(msg.rank, msg.exit_code, time.monotonic())  # it had left its step loop: no fault
    w = hub.board.view(msg.rank)
    if msg.exit_code != 0 and not after_loop:
        hub.timing.fault_began(time.monotonic(), hub.board.views())
    kept = bool(msg.own_state) and hub.rank_states.note_left(msg.rank, msg.attempt, msg.own_step, msg.own_state)
    hub.events.emit("rank_exited", rank=msg.rank, pid=msg.pid, attempt=msg.attempt,
                    exit_code=msg.exit_code, signal=msg.signal, step=w.step, after_loop=after_loop,
                    **({"own_state_of_step": msg.own_step} if kept else {}))
    hub.apply(sm.RankExited(msg.rank, msg.attempt, msg.exit_code, msg.signal, w.step, tuple(msg.last_lines)))


def _rank_status(self: Connections, agent: int, msg: m.RankStatus) -> None:
    """The agent saw a worker's process stop (SIGSTOP, a debugger), turn zombie or run again:
    evidence for the watchdog (hangs.py). A report of another process of the rank is stale."""
    hub = self._hub
    if hub.board.process_status(msg.rank, msg.pid, msg.attempt, msg.status, time.monotonic()):
        hub.events.emit("rank_status", rank=msg.rank, pid=msg.pid, status=msg.status)
        if msg.status != "running" and hub.cfg.worker.node_summaries:  # the stopped-rank rule needs every rank's
            hub.reply(TellAgents(m.FlushReports()))  # place: the agents send their held reports (held_reports.py)


def _ranks_stopped(self: Connections, agent: int, msg: m.RanksStopped) -> None:
    self._hub.events.emit("ranks_stopped", node_rank=agent, attempt=msg.attempt)
    self._hub.apply(sm.AgentStopped(agent, msg.attempt))


def _persisted(self: Connections, agent: int, msg: m.Persisted) -> None:
    """An agent wrote its ranks' files of a step; the manifest commits it once all ranks did."""
    if msg.error:
        self._hub.events.emit("persist_failed", step=msg.step, ranks=msg.ranks, error=msg.error)
    self._hub.apply(sm.StepPersisted(msg.step, tuple(msg.ranks), msg.seconds, msg.error))


def _stop_requested(self: Connections, agent: int, msg: m.StopRequested) -> None:
    try:
        name = signal.Signals(msg.signal).name
    except ValueError:
        name = f"signal {msg.signal}"
    self._hub.terminate(f"terminated ({name}) on node {agent}")


def _agent_event(self: Connections, agent: int, msg: m.AgentEvent) -> None:
    fields = {k: v for k, v in msg.fields.items() if k not in ("node_rank", "t", "event")}
    self._hub.events.emit(msg.name, node_rank=agent, **fields)


def _node_reports(self: Connections, agent: int, msg: m.NodeReports) -> None:
    """An agent's batch of its ranks' step reports (agent/relay.py): each is handled as if the rank
    had sent it here, once it decodes to a relayed type, of a process this attempt knows on that node.
    A run of StepSynced of one step goes through the state machine as one RanksSynced."""
    hub = self._hub
    hub.board.count_received("NodeReports")
    run: list[m.StepSynced] = []  # consecutive StepSynced of one (attempt, gen, step), not applied yet
    commits: dict[tuple[int, int], list[int]] = {}  # the commits told by compute reports (Progress.synced)
    now = time.monotonic()
    ages = msg.ages if len(msg.ages) == len(msg.entries) else [0.0] * len(msg.entries)
    for pid, obj, age in zip(msg.pids, msg.entries, ages):
        try:
            inner = m.decode(obj)
        except ProtocolError as exc:
            log.warning("controller: node %d relayed a bad step report: %s", agent, exc)
            continue
        rank = getattr(inner, "rank", -1)
        if inner.TYPE not in m.RELAYED_TYPES or not 0 <= rank < hub.cfg.world_size:
            log.warning("controller: node %d relayed %s of rank %s (relayed: %s of a rank of the job); dropped",
                        agent, inner.TYPE, rank, ", ".join(m.RELAYED_TYPES))
            continue
        if inner.attempt != hub.state.attempt or pid != hub.board.view(rank).pid or hub.state.agent_of(rank) != agent:
            continue  # an older attempt's, or a process this rank no longer is (fencing, as for a direct report)
        hub.board.count_received(type(inner).__name__, relayed=True)
        if type(inner) is m.Progress:
            sent_t = now - sane_age(age)  # (held on its node: agent/held_reports.py)
            _progress(self, rank, inner.attempt, None, inner, commits, t=sent_t)
            continue
        if commits:  # before a pause or a commit report: the commits told ahead of it
            _ranks_committed(self, commits)
            commits = {}
        if run and not (type(inner) is m.StepSynced and _same_step(run[0], inner)):
            _steps_synced(self, run)
            run = []
        if type(inner) is m.StepSynced:
            run.append(inner)
        else:
            RANK_HANDLERS[type(inner)](self, rank, inner.attempt, None, inner)
    if run:
        _steps_synced(self, run)
    if commits:
        _ranks_committed(self, commits)


def _node_summary(self: Connections, agent: int, msg: m.NodeSummary) -> None:
    """A node's steady steps (setting node_summaries): kept for the watchdog's tick (controller/summaries.py)."""
    hub = self._hub
    hub.board.count_received("NodeSummary")
    if msg.attempt == hub.state.attempt:
        hub.summaries.note(agent, msg, time.monotonic())


def _group_summary(self: Connections, agent: int, msg: m.GroupSummary) -> None:
    """A group of nodes' summaries from its leader (agent/summary_tree.py): kept whole for the watchdog's tick."""
    hub = self._hub
    hub.board.count_received("GroupSummary")
    if not hub.summaries.note_group(msg, time.monotonic()):
        log.warning("controller: agent %d sent a group summary whose columns differ in length from its %d agents; "
                    "dropped", agent, len(msg.agents))


def _ranks_committed(self: Connections, commits: dict[tuple[int, int], list[int]]) -> None:
    """The commits a node's compute reports told (Progress.synced): one transition per step."""
    for (attempt, step), ranks in commits.items():
        self._hub.apply(sm.RanksSynced(RankSet(ranks), attempt, self._hub.state.gen, step))


def _same_step(a: m.StepSynced, b: m.StepSynced) -> bool:
    return (a.attempt, a.gen, a.step) == (b.attempt, b.gen, b.step)


def _steps_synced(self: Connections, run: list[m.StepSynced]) -> None:
    """Several ranks' StepSynced of one step: each rank's part, then one transition for all."""
    for msg in run:
        _note_synced(self._hub, msg.rank, msg.attempt, msg)
    first = run[0]
    self._hub.apply(sm.RanksSynced(RankSet(msg.rank for msg in run), first.attempt, first.gen, first.step))


AGENT_HANDLERS: dict[type, AgentHandler] = {
    m.AgentEvent: _agent_event,
    m.RankStarted: _rank_started, m.RankExited: _rank_exited, m.RankStatus: _rank_status,
    m.RanksStopped: _ranks_stopped,
    m.Persisted: _persisted, m.Heartbeat: lambda self, agent, msg: None, m.StopRequested: _stop_requested,
    m.NodeReports: _node_reports, m.NodeSummary: _node_summary, m.GroupSummary: _group_summary,
}


# -- worker messages -----------------------------------------------------------------------
def _progress(self: Connections, rank: int, attempt: int, conn: Connection | None, msg: m.Progress,
              commits: dict[tuple[int, int], list[int]] | None = None, t: float | None = None) -> None:
    """A step report; ``commits``: where a node's batch collects the commits its reports tell
    ((attempt, step) -> ranks), applied as one transition per step (:func:`_node_reports`); ``t``: when the
    rank sent it (a held report goes on late: agent/held_reports.py), else now."""
    hub = self._hub
    in_loop = msg.phase in STEP_PHASES or msg.done
    if msg.phase == Phase.DONE or msg.done:  # a completed step (folded into the next one's compute report)
        if msg.synced and commits is not None:
            commits.setdefault((attempt, msg.step - 1), []).append(rank)
        elif msg.synced:  # it committed without its commit report (worker/commit.py): this stands for it
            hub.apply(m.StepSynced(rank=rank, attempt=attempt, gen=hub.state.gen, step=msg.step - 1))
        hub.board.reported(rank, Phase.DONE, in_loop=in_loop)
        hub.step_completed(rank, attempt, msg.step, msg.metrics, t)  # the progress the watchdog watches
        if msg.phase == Phase.DONE:
            return
    if msg.phase == Phase.COMPUTE:
        hub.rank_states.note_report(rank, attempt, msg.step, Point.START, msg.state, same=msg.state_same)
        if msg.moved:
            hub.rank_states.note_moved(rank, msg.step - 1)
    hub.board.reported(rank, msg.phase, in_loop=in_loop)
    if msg.phase == Phase.FINISHED:
        hub.board.finishing(rank)
        hub.apply(sm.LoopFinished(rank, attempt))


def _step_synced(self: Connections, rank: int, attempt: int, conn: Connection, msg: m.StepSynced) -> None:
    _note_synced(self._hub, rank, attempt, msg)
    self._hub.apply(m.StepSynced(rank=rank, attempt=attempt, gen=msg.gen, step=msg.step))  # the state is kept


def _sync_state(self: Connections, rank: int, attempt: int, conn: Connection | None, msg: m.SyncState) -> None:
    """Its own state as its reduction began (a vote-less step on a node with no file of it): the state after
    compute, should a peer update the step and this rank be lost (its node with it)."""
    self._hub.rank_states.note_report(rank, attempt, msg.step, Point.AFTER_COMPUTE, msg.state, same=msg.state_same)


def _note_synced(hub: Hub, rank: int, attempt: int, msg: m.StepSynced) -> None:
    hub.rank_states.note_report(rank, attempt, msg.step, Point.AFTER_COMPUTE, msg.state, same=msg.state_same)
    hub.board.synced(rank)  # its reduction is done; it waits in the commit vote


def _claim_fault(self: Connections, rank: int, attempt: int, conn: Connection, msg: m.ClaimFault) -> None:
    hub = self._hub
    granted = hub.board.claim(msg.fault_id)
    if granted:
        hub.events.emit("fault_injected", rank=rank, fault=msg.fault_id, step=hub.board.view(rank).step)
    hub.reply(Reply(conn, m.FaultClaim(fault_id=msg.fault_id, granted=granted)))


def _dumped(self: Connections, rank: int, attempt: int, conn: Connection, msg: m.Dumped) -> None:
    self._hub.events.emit("rank_dumped", rank=rank, step=msg.step, ranks=msg.ranks, error=msg.error)
    self._hub.apply(sm.StepDumped(rank, attempt, msg.step, tuple(msg.ranks), msg.error))


def _damaged(self: Connections, rank: int, attempt: int, conn: Connection, msg: m.RankDamaged) -> None:
    hub = self._hub
    step = hub.board.view(rank).step
    hub.timing.fault_began(time.monotonic(), hub.board.views())
    name = {"non-finite": "non_finite", "sdc": "sdc_detected"}.get(msg.kind, "memory_fault")
    hub.events.emit(name, rank=rank, what=msg.what, kind=msg.kind, step=step)
    hub.apply(sm.RankDamaged(rank, attempt, msg.what, msg.kind, step))


def _paused(self: Connections, rank: int, attempt: int, conn: Connection, msg: m.RankPaused) -> None:
    cut = msg.cut_unsure if msg.cut_in_reduction else None
    self._hub.events.emit("rank_paused", rank=rank, gen=msg.gen, step=msg.step, phase=msg.phase,
                          **({"cut_in_tail": True} if msg.cut_in_tail else {}),
                          **({"cut_in_reduction": cut or "exact"} if cut is not None else {}))
    phase = msg.phase if msg.phase in STEP_PHASES else Phase.COMPUTE
    self._hub.apply(sm.RankPaused(rank, attempt, msg.step, phase, bool(msg.cut_in_tail), cut))


def _resumed(self: Connections, rank: int, attempt: int, conn: Connection, msg: m.RankResumed) -> None:
    hub = self._hub
    hub.timing.resumed(msg.restore_s)
    hub.events.emit("rank_resumed", rank=rank, gen=msg.gen, step=msg.step, restore_s=round(msg.restore_s, 4))
    if msg.phases:  # (one report for both: N of them come at once at the end of a recovery)
        _emit_worker_fields(self, "restore_phases", rank, attempt, msg.phases)
    hub.apply(sm.RankResumed(rank, attempt, msg.gen))


def _restore_offer(self: Connections, rank: int, attempt: int, conn: Connection, msg: m.RestoreOffer) -> None:
    if msg.rank != rank or msg.attempt != attempt:
        log.warning("controller: restore offer of rank %d attempt %d on the connection of rank %d "
                    "attempt %d ignored", msg.rank, msg.attempt, rank, attempt)
        return
    offer = RankOffer.of(msg.memory_steps, msg.storage_steps, msg.peer_steps)
    self._hub.apply(sm.RestoreOffered(rank, attempt, msg.round, offer))


def _rank_event(self: Connections, rank: int, attempt: int, conn: Connection, msg: m.RankEvent) -> None:
    if msg.name == "restored":
        self._hub.timing.restored(attempt, msg.fields.get("step", 0), msg.fields.get("tier", "none"))
    if msg.name == SCRIPT_IMPORTS_EVENT:
        self._script_imports(msg.fields.get("modules"))
        return
    _emit_worker_fields(self, msg.name, rank, attempt, msg.fields)


def _emit_worker_fields(self: Connections, name: str, rank: int, attempt: int, fields: dict) -> None:
    """An event of a worker's, its fields as sent except those the log sets itself (never a crash on a
    worker that names them)."""
    self._hub.events.emit(name, rank=rank, attempt=attempt,
                          **{k: v for k, v in fields.items() if k not in ("rank", "attempt", "t", "event")})


def _register_again(self: Connections, rank: int, attempt: int, conn: Connection, msg: m.RankRegister) -> None:
    if msg.replacement:
        self._replacement_joined(rank, msg.gen)


def _relabelled(event_of: Callable[[Any], Any]) -> RankHandler:
    """A handler for a message that is its own event, with the connection's rank and attempt."""
    def handler(self: Connections, rank: int, attempt: int, conn: Connection, msg: Any) -> None:
        self._hub.apply(dataclasses.replace(event_of(msg), rank=rank, attempt=attempt))
    return handler


RANK_HANDLERS: dict[type, RankHandler] = {
    m.Progress: _progress, m.StepSynced: _step_synced, m.SyncState: _sync_state, m.ClaimFault: _claim_fault,
    m.Dumped: _dumped, m.RankDamaged: _damaged,
    m.RankDegraded: lambda self, rank, attempt, conn, msg: self._hub.degraded(rank, attempt, msg.reason),
    m.SessionReady: _relabelled(lambda msg: msg), m.RankPaused: _paused, m.RankRegister: _register_again,
    m.RankResumed: _resumed, m.RestoreOffer: _restore_offer, m.RankEvent: _rank_event,
    m.Heartbeat: lambda self, rank, attempt, conn, msg: None,
}
