"""The controller's control connections: agents and workers in, events to the state machine out.

One thread per connection (the protocol server's) runs :meth:`Connections.serve`. A message
is looked up in a message-type -> handler table; a handler updates the controller's views
under its lock, logs what happened, and turns the message into an event of the pure state
machine (``Controller.apply``). Sending goes through here too (:meth:`send_to_agent`,
:meth:`broadcast_agents`, :meth:`send_to_workers`), for :mod:`unbroken.controller.executor`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import signal
import time
from collections.abc import Callable
from typing import Any

from unbroken.controller import machine as sm
from unbroken.controller.hub import Hub
from unbroken.controller.rank_state import Point
from unbroken.controller.values import RankSet
from unbroken.controller.views import WorkerView
from unbroken.errors import ConnectionClosed, ProtocolError
from unbroken.names import LIVE_WORKER_STATES, SCRIPT_IMPORTS_EVENT, STEP_PHASES, Phase, WorkerState
from unbroken.protocol import messages as m
from unbroken.protocol.wire import Connection, pack_frame
from unbroken.recovery.restore_point import RankOffer


log = logging.getLogger(__name__)

AgentHandler = Callable[["Connections", int, Any], None]
WorkerHandler = Callable[["Connections", int, int, Connection, Any], None]


@dataclasses.dataclass
class MessageCounts:
    """How many control messages of each type the workers sent and got (under the controller's lock)."""

    received: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    sent: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    # Step messages that travel between the controller and agents for their ranks (NodeReports in,
    # CommitStep out: counted in received/sent too) and the worker reports inside the batches.
    relayed: collections.Counter = dataclasses.field(default_factory=collections.Counter)


class Connections:
    """Owns the agents' connections (by agent id) and serves every control connection."""

    def __init__(self, ctl: Hub) -> None:
        self._ctl = ctl
        self.agents: dict[int, Connection] = {}
        self.spare_imports: list[str] | None = None  # what the script imported (the first report)
        self.counts = MessageCounts()  # workers' messages, by type (the job-end event control_messages)

    # -- serving -------------------------------------------------------------------------
    def serve(self, conn: Connection) -> None:
        try:
            if conn.role == "agent":
                self._serve_agent(conn)
            elif conn.role == "worker":
                self._serve_worker(conn)
            elif conn.role == "store":  # a worker's rendezvous store: not under the controller's lock
                self._ctl.store_service.serve(conn)
            else:
                raise ProtocolError(f"unknown role {conn.role!r} from {conn.peer} (allowed: agent, worker, store)")
        except ConnectionClosed:
            pass
        finally:
            conn.close()

    def _serve_agent(self, conn: Connection) -> None:
        ctl, cfg = self._ctl, self._ctl.cfg
        first = conn.recv(timeout_s=10.0)
        if not isinstance(first, m.AgentRegister):
            raise ProtocolError(f"agent {conn.peer} must register first, sent {type(first).__name__}")
        node = first.node_rank
        if not first.standby and (not 0 <= node < cfg.nnodes or first.nproc != cfg.nproc_per_node):
            conn.send(m.Shutdown(exit_code=2, reason=(
                f"agent of node {node} with --nproc-per-node {first.nproc} does not fit this job "
                f"(--nnodes {cfg.nnodes}, --nproc-per-node {cfg.nproc_per_node})")))
            return
        with ctl.lock:
            if first.standby:  # spares get ids after the nodes
                agent = max([cfg.nnodes - 1, *self.agents]) + 1
                ctl.events.emit("standby_joined", agent=agent, host=first.host, pid=first.pid)
                event: sm.Event = sm.StandbyJoined(agent)
            else:
                agent = node
                ctl.events.emit("agent_joined", node_rank=node, host=first.host, pid=first.pid)
                event = sm.AgentJoined(node)
            self.agents[agent] = conn
            ctl.liveness.heard(agent, time.monotonic())
            ctl.apply(event)
            if self.spare_imports is not None:
                self.send_to_agent(agent, m.SpareImports(modules=self.spare_imports))
        try:
            while True:
                msg = conn.recv()
                with ctl.lock:
                    if self.agents.get(agent) is conn:
                        ctl.liveness.heard(agent, time.monotonic())
                    handler = AGENT_HANDLERS.get(type(msg))
                    if handler is None:
                        log.warning("controller: unexpected %s from an agent", type(msg).__name__)
                    else:
                        handler(self, agent, msg)
        except ConnectionClosed:
            with ctl.lock:
                if self.agents.get(agent) is conn:
                    del self.agents[agent]
                    ctl.liveness.forget(agent)
                    if not ctl.done.is_set():
                        ctl.events.emit("agent_lost", node_rank=agent)
                        self._close_workers_of(agent)
                        last_steps = tuple(ctl.workers[r].step if r in ctl.workers else None
                                           for r in range(ctl.cfg.world_size))
                        ctl.apply(sm.AgentLost(agent, last_steps))
            raise

    def _close_workers_of(self, agent: int) -> None:
        """The control connections of the ranks a lost agent hosted: a frozen or cut-off worker that
        comes back finds them closed and leaves; nothing it sends counts any more (fencing)."""
        ctl = self._ctl
        for w in ctl.workers.values():
            if w.conn is not None and ctl.state.agent_of(w.rank) == agent:
                w.conn.close()

    def _serve_worker(self, conn: Connection) -> None:
        ctl = self._ctl
        first = conn.recv(timeout_s=10.0)
        if not isinstance(first, m.WorkerRegister) or not 0 <= first.rank < ctl.cfg.world_size:
            raise ProtocolError(f"worker {conn.peer} must register with a rank in [0, {ctl.cfg.world_size})")
        with ctl.lock:
            w = ctl.workers[first.rank]
            # Fencing: a process of an older attempt, or one that is not the agent's current
            # process for this rank, never joins.
            if first.attempt != ctl.state.attempt or (w.pid and first.pid != w.pid):
                ctl.events.emit("worker_fenced", rank=first.rank, pid=first.pid, attempt=first.attempt)
                return
            w.conn, w.state, w.relayed = conn, WorkerState.RUNNING, first.relay
            if first.replacement:
                self._replacement_joined(first.rank, first.gen)
        while True:
            msg = conn.recv()
            with ctl.lock:
                self.counts.received[type(msg).__name__] += 1
                if first.attempt != ctl.state.attempt or ctl.workers[first.rank].conn is not conn:
                    continue  # an older attempt's, or a process this rank no longer is
                handler = WORKER_HANDLERS.get(type(msg))
                if handler is not None:
                    handler(self, first.rank, first.attempt, conn, msg)

    def _replacement_joined(self, rank: int, gen: int) -> None:
        ctl = self._ctl
        ctl.timing.mark("joined", time.monotonic(), first=True)
        ctl.events.emit("replacement_joined", rank=rank, gen=gen, attempt=ctl.state.attempt)
        ctl.apply(sm.ReplacementJoined(rank, ctl.state.attempt, gen))

    def _script_imports(self, modules: object) -> None:
        """The first report of what the script imported goes to every agent (for its warm spares)
        and to each agent that registers later; later reports change nothing."""
        if self.spare_imports is not None:
            return
        self.spare_imports = m.spare_import_names(modules)
        self._ctl.events.emit(SCRIPT_IMPORTS_EVENT, count=len(self.spare_imports), modules=self.spare_imports)
        self.broadcast_agents(m.SpareImports(modules=self.spare_imports))

    # -- sending (for the executor) --------------------------------------------------------
    def send_to_agent(self, node: int, msg: m.Message) -> None:
        conn = self.agents.get(node)
        if conn is None:
            return
        try:
            conn.send(msg)
        except (OSError, ProtocolError) as exc:
            log.warning("controller: could not send %s to node %d: %s", type(msg).__name__, node, exc)

    def broadcast_agents(self, msg: m.Message) -> None:
        for node in list(self.agents):
            self.send_to_agent(node, msg)

    def send_commit(self, msg: m.CommitStep) -> None:
        """A step's commit: once to each agent that relays for a live rank (it fans out), directly to the rest."""
        live = [w for w in self._ctl.workers.values() if w.conn is not None and w.state in LIVE_WORKER_STATES]
        self.send_to_workers(msg, {w.rank for w in live if not w.relayed})
        for agent in sorted({self._ctl.state.agent_of(w.rank) for w in live if w.relayed}):
            if agent in self.agents:
                self.send_to_agent(agent, msg)
                self.counts.sent[type(msg).__name__] += 1
                self.counts.relayed["CommitStep"] += 1

    def send_to_workers(self, msg: m.Message, ranks: set[int] | None = None) -> None:
        """Send ``msg`` to every live worker (or those of ``ranks``) that has a connection (encoded once)."""
        try:
            data = pack_frame(m.encode(msg))
        except ProtocolError as exc:  # our own bug: logged, never a dead controller thread
            log.error("controller: could not encode %s for the workers: %s", type(msg).__name__, exc)
            return
        for w in self._ctl.workers.values():
            if w.conn is not None and w.state in LIVE_WORKER_STATES and (ranks is None or w.rank in ranks):
                try:
                    w.conn.send_packed(data)
                    self.counts.sent[type(msg).__name__] += 1
                except (OSError, ProtocolError) as exc:
                    log.warning("controller: could not send %s to rank %d: %s", type(msg).__name__, w.rank, exc)


# -- agent messages ------------------------------------------------------------------------
def _worker_started(self: Connections, agent: int, msg: m.WorkerStarted) -> None:
    w = self._ctl.workers[msg.rank]
    now = time.monotonic()
    w.pid, w.attempt, w.started_t, w.last_progress_t = msg.pid, msg.attempt, now, now
    w.step, w.phase, w.state, w.steps_in_generation = None, Phase.STARTING, WorkerState.STARTING, 0
    w.process, w.process_t = "running", now
    w.in_step_loop = w.relayed = False
    w.compute_s.clear()
    self._ctl.events.emit("worker_started", rank=msg.rank, pid=msg.pid, attempt=msg.attempt)


def _worker_exited(self: Connections, agent: int, msg: m.WorkerExited) -> None:
    ctl = self._ctl
    w = ctl.workers[msg.rank]
    if msg.attempt != ctl.state.attempt:
        return
    after_loop = w.state is WorkerState.FINISHING  # it had reported leaving its step loop: no fault (loop_end.py)
    w.state = WorkerState.FINISHED if msg.exit_code == 0 else WorkerState.FAILED
    if msg.exit_code != 0 and not after_loop:
        ctl.timing.fault_began(time.monotonic(), ctl.workers.values())
    ctl.events.emit("worker_exited", rank=msg.rank, pid=msg.pid, attempt=msg.attempt,
                    exit_code=msg.exit_code, signal=msg.signal, step=w.step, after_loop=after_loop)
    ctl.apply(sm.RankExited(msg.rank, msg.attempt, msg.exit_code, msg.signal, w.step, tuple(msg.last_lines)))


def _worker_status(self: Connections, agent: int, msg: m.WorkerStatus) -> None:
    """The agent saw a worker's process stop (SIGSTOP, a debugger), turn zombie or run again:
    evidence for the hang monitor (hangs.py). A report of another process of the rank is stale."""
    w = self._ctl.workers.get(msg.rank)
    if w is not None and w.pid == msg.pid and w.attempt == msg.attempt:
        w.process, w.process_t = msg.status, time.monotonic()
        self._ctl.events.emit("worker_status", rank=msg.rank, pid=msg.pid, status=msg.status)


def _workers_stopped(self: Connections, agent: int, msg: m.WorkersStopped) -> None:
    self._ctl.events.emit("workers_stopped", node_rank=agent, attempt=msg.attempt)
    self._ctl.apply(sm.AgentStopped(agent, msg.attempt))


def _persisted(self: Connections, agent: int, msg: m.Persisted) -> None:
    """An agent wrote its ranks' files of a step; the manifest commits it once all ranks did."""
    if msg.error:
        self._ctl.events.emit("persist_failed", step=msg.step, ranks=msg.ranks, error=msg.error)
    self._ctl.apply(sm.StepPersisted(msg.step, tuple(msg.ranks), msg.seconds, msg.error))


def _stop_requested(self: Connections, agent: int, msg: m.StopRequested) -> None:
    try:
        name = signal.Signals(msg.signal).name
    except ValueError:
        name = f"signal {msg.signal}"
    self._ctl.terminate(f"terminated ({name}) on node {agent}")


def _agent_event(self: Connections, agent: int, msg: m.AgentEvent) -> None:
    fields = {k: v for k, v in msg.fields.items() if k not in ("node_rank", "t", "event")}
    self._ctl.events.emit(msg.name, node_rank=agent, **fields)


def _node_reports(self: Connections, agent: int, msg: m.NodeReports) -> None:
    """An agent's batch of its ranks' step reports (agent/relay.py): each is handled as if the rank
    had sent it here, once it decodes to a relayed type, of a process this attempt knows on that node.
    A run of StepSynced of one step goes through the state machine as one RanksSynced."""
    ctl = self._ctl
    self.counts.received["NodeReports"] += 1
    run: list[m.StepSynced] = []  # consecutive StepSynced of one (attempt, gen, step), not applied yet
    for pid, obj in zip(msg.pids, msg.entries):
        try:
            inner = m.decode(obj)
        except ProtocolError as exc:
            log.warning("controller: node %d relayed a bad step report: %s", agent, exc)
            continue
        rank = getattr(inner, "rank", -1)
        if inner.TYPE not in m.RELAYED_TYPES or not 0 <= rank < ctl.cfg.world_size:
            log.warning("controller: node %d relayed %s of rank %s (relayed: %s of a rank of the job); dropped",
                        agent, inner.TYPE, rank, ", ".join(m.RELAYED_TYPES))
            continue
        w = ctl.workers[rank]
        if inner.attempt != ctl.state.attempt or pid != w.pid or ctl.state.agent_of(rank) != agent:
            continue  # an older attempt's, or a process this rank no longer is (fencing, as for a direct report)
        self.counts.relayed[type(inner).__name__] += 1
        if run and not (type(inner) is m.StepSynced and _same_step(run[0], inner)):
            _steps_synced(self, run)
            run = []
        if type(inner) is m.StepSynced:
            run.append(inner)
        else:
            WORKER_HANDLERS[type(inner)](self, rank, inner.attempt, None, inner)
    if run:
        _steps_synced(self, run)


def _same_step(a: m.StepSynced, b: m.StepSynced) -> bool:
    return (a.attempt, a.gen, a.step) == (b.attempt, b.gen, b.step)


def _steps_synced(self: Connections, run: list[m.StepSynced]) -> None:
    """Several ranks' StepSynced of one step: each rank's part, then one transition for all."""
    for msg in run:
        _note_synced(self._ctl, msg.rank, msg.attempt, msg)
    first = run[0]
    self._ctl.apply(sm.RanksSynced(RankSet(msg.rank for msg in run), first.attempt, first.gen, first.step))


AGENT_HANDLERS: dict[type, AgentHandler] = {
    m.AgentEvent: _agent_event,
    m.WorkerStarted: _worker_started, m.WorkerExited: _worker_exited, m.WorkerStatus: _worker_status,
    m.WorkersStopped: _workers_stopped,
    m.Persisted: _persisted, m.Heartbeat: lambda self, agent, msg: None, m.StopRequested: _stop_requested,
    m.NodeReports: _node_reports,
}


# -- worker messages -----------------------------------------------------------------------
def _progress(self: Connections, rank: int, attempt: int, conn: Connection, msg: m.Progress) -> None:
    ctl = self._ctl
    w = ctl.workers[rank]
    w.in_step_loop = w.in_step_loop or msg.phase in STEP_PHASES or msg.done
    if msg.phase == Phase.DONE or msg.done:  # a completed step (folded into the next one's compute report)
        w.phase = Phase.DONE
        _step_completed(ctl, w, rank, attempt, msg)
        if msg.phase == Phase.DONE:
            return
    if msg.phase == Phase.COMPUTE:
        ctl.rank_states.note_report(rank, attempt, msg.step, Point.START, msg.state, same=msg.state_same)
    w.phase = msg.phase
    if msg.phase == Phase.FINISHED:
        w.state = WorkerState.FINISHING
        ctl.apply(sm.LoopFinished(rank, attempt))


def _step_completed(ctl: Hub, w: WorkerView, rank: int, attempt: int, msg: m.Progress) -> None:
    """``w`` completed ``msg.step`` steps: the progress the hang monitor watches."""
    ctl.monitor.note_done(w, msg.metrics, time.monotonic())
    w.step = msg.step
    w.metrics = dict(msg.metrics)
    ctl.live.on_step(rank, msg.step, w.metrics)
    ctl.check_recovered()
    if rank == 0:
        for slow, why in ctl.monitor.new_stragglers(ctl.workers.values()):
            ctl.degraded(slow, attempt, why)


def _step_synced(self: Connections, rank: int, attempt: int, conn: Connection, msg: m.StepSynced) -> None:
    _note_synced(self._ctl, rank, attempt, msg)
    self._ctl.apply(m.StepSynced(rank=rank, attempt=attempt, gen=msg.gen, step=msg.step))  # the state is kept


def _note_synced(ctl: Hub, rank: int, attempt: int, msg: m.StepSynced) -> None:
    ctl.rank_states.note_report(rank, attempt, msg.step, Point.AFTER_COMPUTE, msg.state, same=msg.state_same)
    ctl.workers[rank].phase = Phase.SYNC  # its reduction is done; it waits in sync for the commit


def _claim_fault(self: Connections, rank: int, attempt: int, conn: Connection, msg: m.ClaimFault) -> None:
    ctl = self._ctl
    granted = msg.fault_id not in ctl.fired
    ctl.fired.add(msg.fault_id)
    if granted:
        ctl.events.emit("fault_injected", rank=rank, fault=msg.fault_id, step=ctl.workers[rank].step)
    conn.send(m.FaultClaim(fault_id=msg.fault_id, granted=granted))


def _dumped(self: Connections, rank: int, attempt: int, conn: Connection, msg: m.Dumped) -> None:
    self._ctl.events.emit("worker_dumped", rank=rank, step=msg.step, ranks=msg.ranks, error=msg.error)
    self._ctl.apply(sm.StepDumped(rank, attempt, msg.step, tuple(msg.ranks), msg.error))


def _damaged(self: Connections, rank: int, attempt: int, conn: Connection, msg: m.Damaged) -> None:
    ctl = self._ctl
    step = ctl.workers[rank].step
    ctl.timing.fault_began(time.monotonic(), ctl.workers.values())
    name = {"non-finite": "non_finite", "sdc": "sdc_detected"}.get(msg.kind, "memory_fault")
    ctl.events.emit(name, rank=rank, what=msg.what, kind=msg.kind, step=step)
    ctl.apply(sm.WorkerDamaged(rank, attempt, msg.what, msg.kind, step))


def _paused(self: Connections, rank: int, attempt: int, conn: Connection, msg: m.Paused) -> None:
    self._ctl.events.emit("worker_paused", rank=rank, gen=msg.gen, step=msg.step, phase=msg.phase)
    phase = msg.phase if msg.phase in STEP_PHASES else Phase.COMPUTE
    self._ctl.apply(sm.WorkerPaused(rank, attempt, msg.step, phase))


def _resumed(self: Connections, rank: int, attempt: int, conn: Connection, msg: m.Resumed) -> None:
    ctl = self._ctl
    ctl.timing.resumed(msg.restore_s)
    ctl.events.emit("worker_resumed", rank=rank, gen=msg.gen, step=msg.step, restore_s=round(msg.restore_s, 4))
    if msg.phases:  # (one report for both: N of them come at once at the end of a recovery)
        _emit_worker_fields(self, "restore_phases", rank, attempt, msg.phases)
    ctl.apply(sm.WorkerResumed(rank, attempt, msg.gen))


def _restore_offer(self: Connections, rank: int, attempt: int, conn: Connection, msg: m.RestoreOffer) -> None:
    if msg.rank != rank or msg.attempt != attempt:
        log.warning("controller: restore offer of rank %d attempt %d on the connection of rank %d "
                    "attempt %d ignored", msg.rank, msg.attempt, rank, attempt)
        return
    offer = RankOffer.of(msg.memory_steps, msg.storage_steps)
    self._ctl.apply(sm.RestoreOffered(rank, attempt, msg.round, offer))


def _worker_event(self: Connections, rank: int, attempt: int, conn: Connection, msg: m.WorkerEvent) -> None:
    if msg.name == "restored":
        self._ctl.timing.restored(attempt, msg.fields.get("step", 0), msg.fields.get("tier", "none"))
    if msg.name == SCRIPT_IMPORTS_EVENT:
        self._script_imports(msg.fields.get("modules"))
        return
    _emit_worker_fields(self, msg.name, rank, attempt, msg.fields)


def _emit_worker_fields(self: Connections, name: str, rank: int, attempt: int, fields: dict) -> None:
    """An event of a worker's, its fields as sent except those the log sets itself (never a crash on a
    worker that names them)."""
    self._ctl.events.emit(name, rank=rank, attempt=attempt,
                          **{k: v for k, v in fields.items() if k not in ("rank", "attempt", "t", "event")})


def _register_again(self: Connections, rank: int, attempt: int, conn: Connection, msg: m.WorkerRegister) -> None:
    if msg.replacement:
        self._replacement_joined(rank, msg.gen)


def _relabelled(event_of: Callable[[Any], Any]) -> WorkerHandler:
    """A handler for a message that is its own event, with the connection's rank and attempt."""
    def handler(self: Connections, rank: int, attempt: int, conn: Connection, msg: Any) -> None:
        self._ctl.apply(dataclasses.replace(event_of(msg), rank=rank, attempt=attempt))
    return handler


WORKER_HANDLERS: dict[type, WorkerHandler] = {
    m.Progress: _progress, m.StepSynced: _step_synced, m.ClaimFault: _claim_fault,
    m.Dumped: _dumped, m.Damaged: _damaged,
    m.Degraded: lambda self, rank, attempt, conn, msg: self._ctl.degraded(rank, attempt, msg.reason),
    m.SessionReady: _relabelled(lambda msg: msg), m.Paused: _paused, m.WorkerRegister: _register_again,
    m.Resumed: _resumed, m.RestoreOffer: _restore_offer, m.WorkerEvent: _worker_event,
    m.Heartbeat: lambda self, rank, attempt, conn, msg: None,
}
