"""The controller: one per job, inside node 0's agent process (threads, no subprocess).

It owns the control-plane server, the job's TCPStore (a fresh one per attempt, so no
stale rendezvous keys survive a restart and rank 0 dying loses nothing), the view of
every worker (step, phase, last progress), the hang monitor, the fault claims of the
injection plan and the event log. Decisions are made by the pure
:func:`unbroken.controller.machine.transition`; this module only turns messages and
timers into events and carries out the resulting actions.

Threads: one per control connection (the protocol server's), one hang monitor. All
state is guarded by one lock; actions are carried out under it (they only send small
messages).
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from unbroken.config import LaunchConfig
from unbroken.controller import health, machine as sm
from unbroken.controller.eventlog import EventLog
from unbroken.checkpoint.storage import StorageTier
from unbroken.errors import CheckpointError, ConnectionClosed, ProtocolError
from unbroken.names import LIVE_WORKER_STATES, STEP_PHASES, Phase, Rung, WorkerState
from unbroken.protocol import messages as m
from unbroken.protocol.wire import Connection, Server
from unbroken.recovery.restore_point import RankOffer, decide_restore

log = logging.getLogger(__name__)

MONITOR_INTERVAL_S = 0.1


@dataclass
class WorkerView:
    """What the controller knows of one rank in the current attempt."""

    rank: int
    pid: int = 0
    attempt: int = -1
    started_t: float = 0.0
    last_progress_t: float = 0.0
    step: int | None = None  # steps completed, as last reported
    phase: str = Phase.STARTING
    steps_in_attempt: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)
    compute_t: float = 0.0  # when the step in flight began (its 'compute' report)
    compute_s: deque[float] = field(default_factory=lambda: deque(maxlen=health.WINDOW))
    state: WorkerState = WorkerState.STARTING
    conn: Connection | None = None


@dataclass
class Outcome:
    exit_code: int
    reason: str


class Controller:
    def __init__(self, cfg: LaunchConfig, *, host: str, port: int, events: EventLog) -> None:
        self.cfg = cfg
        self.host = host
        self.events = events
        self._lock = threading.RLock()
        self._state = sm.JobState(world_size=cfg.world_size, nnodes=cfg.nnodes,
                                  max_restarts=cfg.max_restarts, allowed=cfg.recover_strategy,
                                  replicas_allowed=not cfg.no_replica_restore,
                                  can_dump=bool(cfg.checkpoint.save_dir),
                                  sub_health_policy=cfg.sub_health_policy,
                                  crash_loop_limit=cfg.crash_loop_limit)
        self._agents: dict[int, Connection] = {}
        self._workers = {r: WorkerView(rank=r) for r in range(cfg.world_size)}
        self._step_times: deque[float] = deque(maxlen=200)
        self._fired: set[str] = set()
        self._stragglers: set[int] = set()  # ranks the straggler rule reported (once per job)
        self._store: dist.TCPStore | None = None
        self._stores: list[dist.TCPStore] = []
        self._outcome: Outcome | None = None
        self._done = threading.Event()
        self._fault_t: float | None = None  # when the failure being recovered was detected
        self._fault_step = 0
        self._resume_step: int | None = None  # where an in-flight recovery resumed
        self._recovery_t: dict[str, float] = {}  # in-flight recovery milestones (monotonic)
        self._restore_s: list[float] = []
        self._recovery_deadline: tuple[int, float] | None = None  # (generation, monotonic deadline)
        self._persisted: dict[int, set[int]] = {}  # step -> ranks whose files are in storage
        # Restore at a (re)start, per (attempt, round): the offers so far, then the decided step.
        self._restore_offers: dict[tuple[int, int], dict[int, RankOffer]] = {}
        self._restore_steps: dict[tuple[int, int], int] = {}
        ckpt = cfg.checkpoint
        self._storage = StorageTier(ckpt.save_dir, keep=ckpt.keep) if ckpt.save_dir else None
        self._server = Server(host, port, cfg.secret.encode(), self._on_connection)
        self._monitor = threading.Thread(target=self._monitor_loop, name="unbroken-hang-monitor", daemon=True)

    @property
    def port(self) -> int:
        return self._server.port

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> None:
        self._server.start()
        self._monitor.start()
        self.events.emit("controller_started", address=self.address, world_size=self.cfg.world_size,
                         nnodes=self.cfg.nnodes, max_restarts=self.cfg.max_restarts,
                         recover_strategy=list(self.cfg.recover_strategy))

    def wait(self, timeout_s: float | None = None) -> Outcome | None:
        self._done.wait(timeout_s)
        return self._outcome

    def abort(self, reason: str, exit_code: int = 130) -> None:
        """Stop the job from outside (Ctrl-C): every agent stops its workers."""
        with self._lock:
            self._execute([sm.StopAttempt(self._state.attempt, reason), sm.Finish(exit_code, reason)])

    def close(self, drain_s: float = 10.0) -> None:
        """Stop serving; first let the agents finish (their last reports, e.g. a checkpoint
        persisted at the end of the job, are still taken in)."""
        self._done.set()
        deadline = time.monotonic() + drain_s
        while self._agents and time.monotonic() < deadline:
            time.sleep(0.02)
        self._server.close()
        self._stores.clear()
        self._store = None

    # -- views for status and the demo ---------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "phase": self._state.phase.value,
                "attempt": self._state.attempt,
                "restarts_used": self._state.restarts_used,
                "median_step_s": self._median_step_s(),
                "workers": [
                    {"rank": w.rank, "pid": w.pid, "step": w.step, "phase": w.phase, "state": w.state,
                     "metrics": dict(w.metrics)} for w in self._workers.values()],
            }

    @property
    def first_failure(self) -> sm.Failure | None:
        with self._lock:
            return self._state.first_failure

    # -- connections ---------------------------------------------------------------------
    def _on_connection(self, conn: Connection) -> None:
        try:
            if conn.role == "agent":
                self._serve_agent(conn)
            elif conn.role == "worker":
                self._serve_worker(conn)
            else:
                raise ProtocolError(f"unknown role {conn.role!r} from {conn.peer} (allowed: agent, worker)")
        except ConnectionClosed:
            pass
        finally:
            conn.close()

    def _serve_agent(self, conn: Connection) -> None:
        first = conn.recv(timeout_s=10.0)
        if not isinstance(first, m.AgentRegister):
            raise ProtocolError(f"agent {conn.peer} must register first, sent {type(first).__name__}")
        node = first.node_rank
        if not first.standby and (not 0 <= node < self.cfg.nnodes or first.nproc != self.cfg.nproc_per_node):
            conn.send(m.Shutdown(exit_code=2, reason=(
                f"agent of node {node} with --nproc-per-node {first.nproc} does not fit this job "
                f"(--nnodes {self.cfg.nnodes}, --nproc-per-node {self.cfg.nproc_per_node})")))
            return
        with self._lock:
            if first.standby:  # spares get ids after the nodes
                agent = max([self.cfg.nnodes - 1, *self._agents]) + 1
                self.events.emit("standby_joined", agent=agent, host=first.host, pid=first.pid)
                event: sm.Event = sm.StandbyJoined(agent)
            else:
                agent = node
                self.events.emit("agent_joined", node_rank=node, host=first.host, pid=first.pid)
                event = sm.AgentJoined(node)
            self._agents[agent] = conn
            self._apply(event)
        try:
            while True:
                self._on_agent_message(agent, conn.recv())
        except ConnectionClosed:
            with self._lock:
                if self._agents.get(agent) is conn:
                    del self._agents[agent]
                    if not self._done.is_set():
                        self.events.emit("agent_lost", node_rank=agent)
                        self._apply(sm.AgentLost(agent))
            raise

    def _on_agent_message(self, agent: int, msg: m.Message) -> None:
        with self._lock:
            if isinstance(msg, m.WorkerStarted):
                w = self._workers[msg.rank]
                now = time.monotonic()
                w.pid, w.attempt, w.started_t, w.last_progress_t = msg.pid, msg.attempt, now, now
                w.step, w.phase, w.state, w.steps_in_attempt = None, Phase.STARTING, WorkerState.STARTING, 0
                w.compute_s.clear()
                self.events.emit("worker_started", rank=msg.rank, pid=msg.pid, attempt=msg.attempt)
            elif isinstance(msg, m.WorkerExited):
                self._on_worker_exited(msg)
            elif isinstance(msg, m.WorkersStopped):
                self.events.emit("workers_stopped", node_rank=agent, attempt=msg.attempt)
                self._apply(sm.AgentStopped(agent, msg.attempt))
            elif isinstance(msg, m.Persisted):
                self._on_persisted(msg)
            elif isinstance(msg, m.Heartbeat):
                pass
            else:
                log.warning("controller: unexpected %s from an agent", type(msg).__name__)

    def _on_persisted(self, msg: m.Persisted) -> None:
        """An agent wrote its ranks' files of a step; the manifest commits it once all ranks did."""
        if msg.error:
            self.events.emit("persist_failed", step=msg.step, ranks=msg.ranks, error=msg.error)
            self._persisted.pop(msg.step, None)
            return
        done = self._persisted.setdefault(msg.step, set())
        done.update(msg.ranks)
        if len(done) < self.cfg.world_size:
            return
        del self._persisted[msg.step]
        for older in [s for s in self._persisted if s < msg.step]:
            del self._persisted[older]  # superseded: never committed
        try:
            self._storage.commit(msg.step, self.cfg.world_size)
        except (CheckpointError, OSError) as exc:
            self.events.emit("persist_failed", step=msg.step, error=str(exc))
            return
        self.events.emit("checkpoint_persisted", step=msg.step, seconds=round(msg.seconds, 4), tier="storage")

    def _on_worker_exited(self, msg: m.WorkerExited) -> None:
        w = self._workers[msg.rank]
        if msg.attempt != self._state.attempt:
            return
        w.state = WorkerState.FINISHED if msg.exit_code == 0 else WorkerState.FAILED
        if msg.exit_code != 0:
            self._fault_began(time.monotonic())
        self.events.emit("worker_exited", rank=msg.rank, pid=msg.pid, attempt=msg.attempt,
                         exit_code=msg.exit_code, signal=msg.signal, step=w.step)
        self._apply(sm.WorkerExited(msg.rank, msg.attempt, msg.exit_code, msg.signal, w.step,
                                    tuple(msg.last_lines)))

    def _serve_worker(self, conn: Connection) -> None:
        first = conn.recv(timeout_s=10.0)
        if not isinstance(first, m.WorkerRegister) or not 0 <= first.rank < self.cfg.world_size:
            raise ProtocolError(f"worker {conn.peer} must register with a rank in [0, {self.cfg.world_size})")
        with self._lock:
            w = self._workers[first.rank]
            # Fencing: a process of an older attempt, or one that is not the agent's current
            # process for this rank, never joins.
            if first.attempt != self._state.attempt or (w.pid and first.pid != w.pid):
                self.events.emit("worker_fenced", rank=first.rank, pid=first.pid, attempt=first.attempt)
                return
            w.conn, w.state = conn, WorkerState.RUNNING
            if first.replacement:
                self._on_replacement_joined(first.rank, first.gen)
        while True:
            self._on_worker_message(first.rank, first.attempt, conn, conn.recv())

    def _on_replacement_joined(self, rank: int, gen: int) -> None:
        self._recovery_t.setdefault("joined", time.monotonic())
        self.events.emit("replacement_joined", rank=rank, gen=gen, attempt=self._state.attempt)
        self._apply(sm.ReplacementJoined(rank, self._state.attempt, gen))

    def _on_worker_message(self, rank: int, attempt: int, conn: Connection, msg: m.Message) -> None:
        with self._lock:
            if attempt != self._state.attempt:
                return
            w = self._workers[rank]
            if w.conn is not conn:
                return  # a connection of a process this rank no longer is
            if isinstance(msg, m.Progress):
                w.phase = msg.phase
                if msg.phase == Phase.FINISHED:
                    w.state = WorkerState.FINISHING
                elif msg.phase == Phase.COMPUTE:
                    w.compute_t = time.monotonic()
                elif msg.phase == Phase.SYNC and w.compute_t:
                    w.compute_s.append(time.monotonic() - w.compute_t)
                    w.compute_t = 0.0
                if msg.phase == Phase.DONE:  # a completed step: the progress the hang monitor watches
                    now = time.monotonic()
                    if w.steps_in_attempt:
                        self._step_times.append(now - w.last_progress_t)
                    w.last_progress_t, w.step = now, msg.step
                    w.steps_in_attempt += 1
                    w.metrics = dict(msg.metrics)
                    self._check_recovered()
                    if rank == 0:
                        self._check_stragglers(attempt)
            elif isinstance(msg, m.StepSynced):
                self._apply(sm.StepSynced(rank, attempt, msg.gen, msg.step))
            elif isinstance(msg, m.ClaimFault):
                granted = msg.fault_id not in self._fired
                self._fired.add(msg.fault_id)
                if granted:
                    self.events.emit("fault_injected", rank=rank, fault=msg.fault_id, step=w.step)
                conn.send(m.FaultClaim(fault_id=msg.fault_id, granted=granted))
            elif isinstance(msg, m.Dumped):
                self.events.emit("worker_dumped", rank=rank, step=msg.step, ranks=msg.ranks, error=msg.error)
                self._apply(sm.StepDumped(rank, attempt, msg.step, tuple(msg.ranks), msg.error))
            elif isinstance(msg, m.Damaged):
                self._fault_began(time.monotonic())
                name = {"non-finite": "non_finite", "sdc": "sdc_detected"}.get(msg.kind, "memory_fault")
                self.events.emit(name, rank=rank, what=msg.what, kind=msg.kind, step=w.step)
                self._apply(sm.WorkerDamaged(rank, attempt, msg.what, msg.kind, w.step))
            elif isinstance(msg, m.Degraded):
                self._degraded(rank, attempt, msg.reason)
            elif isinstance(msg, m.SessionReady):
                self._apply(sm.SessionReady(rank, attempt, msg.num_replicas))
            elif isinstance(msg, m.Paused):
                self.events.emit("worker_paused", rank=rank, gen=msg.gen, step=msg.step, phase=msg.phase)
                phase = msg.phase if msg.phase in STEP_PHASES else Phase.COMPUTE
                self._apply(sm.WorkerPaused(rank, attempt, msg.step, phase))
            elif isinstance(msg, m.WorkerRegister) and msg.replacement:
                self._on_replacement_joined(rank, msg.gen)
            elif isinstance(msg, m.Resumed):
                self._restore_s.append(msg.restore_s)
                self.events.emit("worker_resumed", rank=rank, gen=msg.gen, step=msg.step,
                                 restore_s=round(msg.restore_s, 4))
                self._apply(sm.WorkerResumed(rank, attempt, msg.gen))
            elif isinstance(msg, m.RestoreOffer):
                self._on_restore_offer(rank, attempt, conn, msg)
            elif isinstance(msg, m.WorkerEvent):
                self.events.emit(msg.name, rank=rank, attempt=attempt, **msg.fields)
            elif isinstance(msg, m.Heartbeat):
                pass

    def _check_recovered(self) -> None:
        """After a restart: once every rank is back at the step the fault hit, log the recovery."""
        if self._fault_t is None or self._state.phase is not sm.JobPhase.RUNNING:
            return
        if all((w.step or 0) >= self._fault_step for w in self._workers.values()):
            if self._resume_step is not None:  # in flight: state came from live replicas
                restored_step, tier = self._resume_step, "replicas"
            else:
                restored = [r for r in self.events.records("restored") if r.get("attempt") == self._state.attempt]
                restored_step = restored[0]["step"] if restored else 0
                tier = restored[0]["tier"] if restored else "none"
            self.events.emit("recovered", attempt=self._state.attempt, step=self._fault_step,
                             recover_s=round(time.monotonic() - self._fault_t, 4),
                             restored_step=restored_step, tier=tier)
            self._fault_t, self._resume_step = None, None

    def _check_stragglers(self, attempt: int) -> None:
        """The straggler rule (``--straggler-factor``): a slow rank is reported degraded, once."""
        timings = {w.rank: w.compute_s for w in self._workers.values()}
        for rank, median_s, job_s in health.stragglers(timings, self.cfg.straggler_factor):
            if rank in self._stragglers:
                continue
            self._stragglers.add(rank)
            self._degraded(rank, attempt, health.describe(median_s, job_s))

    def _fault_began(self, t: float) -> None:
        """Note when (monotonic ``t``) and at which step the failure being recovered began,
        unless one is already being timed (the first fault of a cascade counts)."""
        if self._fault_t is None:
            self._fault_t, self._fault_step = t, max((v.step or 0) for v in self._workers.values())

    def _degraded(self, rank: int, attempt: int, reason: str) -> None:
        """A rank reported (or found) degraded: log it; the state machine applies the policy."""
        step = self._workers[rank].step
        if self.cfg.sub_health_policy == "grace-exit":
            self._fault_began(time.monotonic())
        self.events.emit("sub_health", rank=rank, reason=reason, step=step, policy=self.cfg.sub_health_policy)
        self._apply(sm.WorkerDegraded(rank, attempt, reason, step))

    # -- hang monitor ----------------------------------------------------------------------
    def _median_step_s(self) -> float | None:
        return statistics.median(self._step_times) if self._step_times else None

    def hang_timeout_s(self, w: WorkerView) -> float:
        hang = self.cfg.hang
        if w.steps_in_attempt == 0:
            return hang.first_step_timeout_s
        if hang.timeout_s is not None:
            return hang.timeout_s
        median = self._median_step_s() or 0.0
        return max(hang.floor_s, hang.factor * median)

    def _monitor_loop(self) -> None:
        while not self._done.wait(MONITOR_INTERVAL_S):
            with self._lock:
                now = time.monotonic()
                if self._state.phase is sm.JobPhase.RUNNING and not self._state.hung_ranks:
                    self._check_hangs(now)
                if self._recovery_deadline and now > self._recovery_deadline[1]:
                    gen, self._recovery_deadline = self._recovery_deadline[0], None
                    self.events.emit("recovery_timeout", gen=gen, timeout_s=self.cfg.recovery_timeout_s)
                    self._apply(sm.RecoveryTimeout(self._state.attempt, gen))

    def _check_hangs(self, now: float) -> None:
        live = [w for w in self._workers.values()
                if w.attempt == self._state.attempt and w.state in LIVE_WORKER_STATES]
        hung = [w for w in live if now - w.last_progress_t > self.hang_timeout_s(w)]
        if not hung:
            return
        # Ranks blocked in a collective ('sync') are usually waiting for the hung one:
        # suspect the others first, the longest silent first.
        w = min(hung, key=lambda v: (v.phase == Phase.SYNC, v.last_progress_t))
        silent = now - w.last_progress_t
        self._fault_began(w.last_progress_t)  # the hang began when its progress stopped, not when we noticed
        self.events.emit("hang_detected", rank=w.rank, step=w.step, phase=w.phase, silent_s=round(silent, 3),
                         timeout_s=round(self.hang_timeout_s(w), 3), median_step_s=self._median_step_s(),
                         attempt=w.attempt)
        self._apply(sm.WorkerHung(w.rank, w.attempt, w.step, silent))

    # -- the state machine and its actions ---------------------------------------------
    def _apply(self, event: sm.Event) -> None:
        self._state, actions = sm.transition(self._state, event)
        self._execute(actions)

    def _execute(self, actions: list[sm.Action]) -> None:
        for action in actions:
            if isinstance(action, sm.StartAttempt):
                self._start_attempt(action.attempt)
            elif isinstance(action, sm.StopAttempt):
                self.events.emit("stop_workers", attempt=action.attempt, reason=action.reason)
                self._broadcast(m.StopWorkers(attempt=action.attempt, reason=action.reason))
            elif isinstance(action, sm.KillWorker):
                w = self._workers[action.rank]
                self.events.emit("kill_worker", rank=action.rank, pid=w.pid, reason=action.reason)
                self._send_to_node(self._state.agent_of(action.rank),
                                   m.KillWorker(rank=action.rank, pid=w.pid, reason=action.reason))
            elif isinstance(action, sm.Decide):
                f = action.failure
                self.events.emit("decision", rung=action.rung, rank=f.rank, kind=f.kind, step=f.step,
                                 attempt=f.attempt, committed_step=self._state.committed_step, reason=action.reason)
                if action.rung != Rung.RECOVER_IN_PLACE:
                    self._recovery_deadline = None
            elif isinstance(action, sm.CommitStep):
                self._to_workers(m.CommitStep(gen=action.gen, step=action.step))
            elif isinstance(action, sm.AbortGeneration):
                self._recovery_t = {"decide": time.monotonic()}
                self._recovery_deadline = (action.gen, time.monotonic() + self.cfg.recovery_timeout_s)
                self.events.emit("abort_generation", gen=action.gen)
                self._to_workers(m.Abort(gen=action.gen, reason=action.reason))
            elif isinstance(action, sm.RestartRanks):
                for rank in sorted(action.ranks):
                    w = self._workers[rank]
                    w.state, w.conn, w.pid = WorkerState.STARTING, None, 0
                    self.events.emit("restart_worker", rank=rank, gen=action.gen, agent=action.agent)
                    self._send_to_node(action.agent, m.RestartWorker(
                        rank=rank, attempt=self._state.attempt, gen=action.gen,
                        store_host=self.host, store_port=self._store.port if self._store else 0,
                        world_size=self.cfg.world_size))
            elif isinstance(action, sm.Regroup):
                self._recovery_t["regroup"] = time.monotonic()
                self.events.emit("regroup", gen=action.gen, resume_step=action.resume_step,
                                 replaced=sorted(action.replaced), direction=action.direction, reason=action.reason)
                self._to_workers(m.Regroup(gen=action.gen, resume_step=action.resume_step,
                                           replaced=sorted(action.replaced)))
            elif isinstance(action, sm.Recovered):
                self._on_recovered_in_flight(action)
            elif isinstance(action, sm.DumpOrder):
                self.events.emit("dump", gen=action.gen, step=action.step, assign=[list(p) for p in action.assign])
                self._to_workers(m.Dump(gen=action.gen, step=action.step, assign=[list(p) for p in action.assign]))
            elif isinstance(action, sm.CommitDump):
                try:
                    self._storage.commit(action.step, self.cfg.world_size, {"dump": True})
                    self.events.emit("dump_committed", step=action.step)
                except (CheckpointError, OSError, AttributeError) as exc:
                    self.events.emit("dump_failed", step=action.step, error=str(exc))
            elif isinstance(action, sm.Finish):
                self._finish(action)

    def _on_recovered_in_flight(self, action: sm.Recovered) -> None:
        now = time.monotonic()
        t = self._recovery_t
        self._recovery_deadline = None
        self._resume_step = action.resume_step
        for w in self._workers.values():  # paused ranks made no progress on purpose
            w.last_progress_t = now
        decide = t.get("decide", now)
        self.events.emit(
            "recovered_in_flight", gen=action.gen, resume_step=action.resume_step, replaced=sorted(action.replaced),
            detect_s=round(decide - self._fault_t, 4) if self._fault_t else None,
            replace_s=round(t.get("joined", decide) - decide, 4),
            regroup_s=round(t.get("regroup", now) - max(decide, t.get("joined", decide)), 4),
            restore_s=round(max(self._restore_s, default=0.0), 4),
            total_s=round(now - (self._fault_t or decide), 4),
            steps_redone=max(0, self._fault_step - action.resume_step))
        self._restore_s = []

    def _to_workers(self, msg: m.Message) -> None:
        for w in self._workers.values():
            if w.conn is not None and w.state in LIVE_WORKER_STATES:
                try:
                    w.conn.send(msg)
                except (OSError, ProtocolError) as exc:
                    log.warning("controller: could not send %s to rank %d: %s", type(msg).__name__, w.rank, exc)

    def _start_attempt(self, attempt: int) -> None:
        # A fresh store per attempt: no stale rendezvous keys (FACTS.md: torchrun restarts).
        store = dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False, use_libuv=True)
        self._stores = [store]  # the previous attempt's store goes: all its workers are dead
        self._store = store
        for w in self._workers.values():
            w.state, w.steps_in_attempt = WorkerState.STARTING, 0
        self.events.emit("attempt_started", attempt=attempt, store_port=store.port)
        for agent in sorted(self._state.hosts()):
            ranks = [r for r in range(self.cfg.world_size) if self._state.agent_of(r) == agent]
            self._send_to_node(agent, m.StartWorkers(attempt=attempt, store_host=self.host, store_port=store.port,
                                                     world_size=self.cfg.world_size, ranks=ranks))

    def _finish(self, action: sm.Finish) -> None:
        self._outcome = Outcome(action.exit_code, action.reason)
        self.events.emit("job_finished", exit_code=action.exit_code, reason=action.reason)
        self._broadcast(m.Shutdown(exit_code=action.exit_code, reason=action.reason))
        self._done.set()

    def _broadcast(self, msg: m.Message) -> None:
        for node in list(self._agents):
            self._send_to_node(node, msg)

    def _send_to_node(self, node: int, msg: m.Message) -> None:
        conn = self._agents.get(node)
        if conn is None:
            return
        try:
            conn.send(msg)
        except (OSError, ProtocolError) as exc:
            log.warning("controller: could not send %s to node %d: %s", type(msg).__name__, node, exc)

    def _on_restore_offer(self, rank: int, attempt: int, conn: Connection, msg: m.RestoreOffer) -> None:
        """A rank offers the steps it can load; once every rank offered for this round, decide
        the newest step committed for all (older than any decided in an earlier round: some
        rank could not load that one), log it, and tell every rank."""
        if msg.rank != rank or msg.attempt != attempt:
            log.warning("controller: restore offer of rank %d attempt %d on the connection of rank %d "
                        "attempt %d ignored", msg.rank, msg.attempt, rank, attempt)
            return
        key = (attempt, msg.round)
        for old in [k for k in (*self._restore_offers, *self._restore_steps) if k[0] < attempt]:
            self._restore_offers.pop(old, None)  # a previous attempt's restore is over
            self._restore_steps.pop(old, None)
        if key in self._restore_steps:  # decided already (a repeated offer): answer again
            conn.send(m.RestoreAt(attempt=attempt, round=msg.round, step=self._restore_steps[key]))
            return
        offers = self._restore_offers.setdefault(key, {})
        offers[rank] = RankOffer.of(msg.memory_steps, msg.storage_steps)
        if len(offers) < self.cfg.world_size:
            return
        del self._restore_offers[key]
        below = min((step for (a, r), step in self._restore_steps.items() if a == attempt and r < msg.round),
                    default=None)
        point = decide_restore(offers, self.cfg.world_size, below=below)
        self._restore_steps[key] = point.step
        self.events.emit("restore_decided", attempt=attempt, round=msg.round, step=point.step, tier=point.tier,
                         tiers=list(point.tiers), below=below, reason=point.reason)
        self._to_workers(m.RestoreAt(attempt=attempt, round=msg.round, step=point.step))
