"""The controller: one per job, inside node 0's agent process (threads, no subprocess).

:class:`Controller` is the hub: it owns the job state of the pure state machine
(:func:`unbroken.controller.machine.transition`), the view of every worker, the lock that
guards them, and the pieces that each do one job:

* :class:`~unbroken.controller.connections.Connections` -- the control-plane connections:
  messages in (a message-type -> handler table), turned into events;
* :class:`~unbroken.controller.executor.Executor` -- the machine's actions out, as messages
  (it opens each attempt's rendezvous store);
* :class:`~unbroken.controller.store_service.StoreService` -- the rendezvous store the workers
  use, served over the control plane (its own lock; one table per attempt);
* :class:`~unbroken.controller.monitor.Monitor` -- step times, the hang and straggler rules
  (who a hang is blamed on: :mod:`unbroken.controller.hangs`);
* :class:`~unbroken.controller.timing.RecoveryTiming` -- how long each recovery took;
* the event log (``events.jsonl``), the live status/metrics (:class:`~unbroken.ops.monitor.JobMonitor`,
  fed by the log and by completed steps) and the storage tier the persisted steps commit into.

Threads: one per control connection (the protocol server's), one hang monitor. All state is
guarded by :attr:`Controller.lock`; actions are carried out under it (they only send small
messages). The attributes without a leading underscore are what the pieces share.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from unbroken.checkpoint.launch_dirs import run_id
from unbroken.checkpoint.storage import StorageTier
from unbroken.config import LaunchConfig
from unbroken.controller import machine as sm
from unbroken.controller.connections import Connections
from unbroken.controller.eventlog import EventLog
from unbroken.controller.executor import Executor
from unbroken.controller.hangs import RankProgress
from unbroken.controller.liveness import Liveness
from unbroken.controller.monitor import MONITOR_INTERVAL_S, Monitor
from unbroken.controller.rank_state import RankStates
from unbroken.controller.store_service import StoreService
from unbroken.controller.timing import RecoveryTiming
from unbroken.controller.views import Outcome, WorkerView
from unbroken.ops.monitor import JobMonitor
from unbroken.protocol.messages import PER_RANK_LIMIT_BYTES, Heartbeat
from unbroken.protocol.wire import Server

__all__ = ["Controller", "Outcome", "WorkerView", "MONITOR_INTERVAL_S"]


class Controller:
    """One job's controller (see the module docstring). Public API: :meth:`start`,
    :meth:`wait`, :meth:`abort`, :meth:`close`, :meth:`snapshot`, :attr:`first_failure`."""

    def __init__(self, cfg: LaunchConfig, *, host: str, port: int, events: EventLog) -> None:
        self.cfg = cfg
        self.host = host
        self.events = events
        self.lock = threading.RLock()
        self.state = sm.JobState(sm.JobPolicy(
            world_size=cfg.world_size, nnodes=cfg.nnodes, max_restarts=cfg.max_restarts,
            allowed=cfg.recover_strategy, replicas_allowed=not cfg.no_replica_restore,
            can_dump=bool(cfg.checkpoint.save_dir), sub_health_policy=cfg.sub_health_policy,
            crash_loop_limit=cfg.crash_loop_limit, max_recurring=cfg.max_recurring_recoveries))
        self.workers = {r: WorkerView(rank=r) for r in range(cfg.world_size)}
        self.fired: set[str] = set()  # fault ids of the injection plan already claimed
        self.outcome: Outcome | None = None
        self.done = threading.Event()
        self.recovery_deadline: tuple[int, float] | None = None  # (generation, monotonic deadline)
        self.grace_deadline: float | None = None  # monotonic end of the SIGTERM dump (--sigterm-dump-timeout-s)
        ckpt = cfg.checkpoint
        self.storage = StorageTier(ckpt.save_dir, keep=ckpt.keep, run_id=run_id(cfg.secret, cfg.job_id)) \
            if ckpt.save_dir else None
        self.timing = RecoveryTiming()
        self.monitor = Monitor(cfg.hang, cfg.straggler_factor)
        self.rank_states = RankStates(PER_RANK_LIMIT_BYTES)  # each rank's own state, for its replacement
        self.liveness = Liveness(cfg.node_timeout_s)  # heartbeats: silent nodes are lost (liveness.py)
        self.connections = Connections(self)
        self.store_service = StoreService()
        self._executor = Executor(self)
        self._server = Server(host, port, cfg.secret.encode(), self.connections.serve,
                              on_failed_handshakes=lambda count, last: self.events.emit(
                                  "handshakes_failed", count=count, last=last))
        self._monitor_thread = threading.Thread(target=self._monitor_loop, name="unbroken-hang-monitor",
                                                daemon=True)
        self.live = JobMonitor(run_dir=cfg.run_dir, job_id=cfg.job_id, world_size=cfg.world_size, events=events,
                               snapshot=self.snapshot, host=host, metrics_port=cfg.metrics_port)
        events.listeners.append(self.live.on_record)  # status, metrics and the page follow the log

    @property
    def port(self) -> int:
        return self._server.port

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> None:
        self._server.start()
        self._monitor_thread.start()
        self.live.start()
        self.events.emit("controller_started", address=self.address, world_size=self.cfg.world_size,
                         nnodes=self.cfg.nnodes, max_restarts=self.cfg.max_restarts,
                         recover_strategy=list(self.cfg.recover_strategy))

    def wait(self, timeout_s: float | None = None) -> Outcome | None:
        self.done.wait(timeout_s)
        return self.outcome

    def abort(self, reason: str, exit_code: int = 130) -> None:
        """Stop the job from outside (Ctrl-C): every agent stops its workers."""
        with self.lock:
            self._executor.execute([sm.StopAttempt(self.state.attempt, reason), sm.Finish(exit_code, reason)])

    def close(self, drain_s: float = 10.0) -> None:
        """Stop serving; first let the agents finish (their last reports, e.g. a checkpoint
        persisted at the end of the job, are still taken in)."""
        self.done.set()
        deadline = time.monotonic() + drain_s
        while self.connections.agents and time.monotonic() < deadline:
            time.sleep(0.02)
        self.store_service.close()
        self._server.close()
        self.live.close()
        self._executor.close()

    # -- views for status and the demo ---------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {
                "phase": self.state.phase.value,
                "attempt": self.state.attempt,
                "restarts_used": self.state.restarts_used,
                "median_step_s": self.monitor.median_step_s(),
                "workers": [
                    {"rank": w.rank, "pid": w.pid, "step": w.step, "phase": w.phase, "state": w.state,
                     "metrics": dict(w.metrics)} for w in self.workers.values()],
            }

    @property
    def first_failure(self) -> sm.Failure | None:
        with self.lock:
            return self.state.first_failure

    def hang_timeout_s(self, w: WorkerView) -> float:
        return self.monitor.hang_timeout_s(w)

    # -- shared by the pieces (under the lock) ----------------------------------------------
    def apply(self, event: sm.Event) -> None:
        """One event through the pure state machine; its actions carried out at once."""
        self.state, actions = sm.transition(self.state, event)
        self._executor.execute(actions)

    def degraded(self, rank: int, attempt: int, reason: str) -> None:
        """A rank reported (or found) degraded: log it; the state machine applies the policy."""
        step = self.workers[rank].step
        if self.cfg.sub_health_policy == "grace-exit":
            self.timing.fault_began(time.monotonic(), self.workers.values())
        self.events.emit("sub_health", rank=rank, reason=reason, step=step, policy=self.cfg.sub_health_policy)
        self.apply(sm.WorkerDegraded(rank, attempt, reason, step))

    def terminate(self, reason: str) -> None:
        """An agent got SIGTERM: the job dumps its newest committed step where it can, then stops
        with exit code 143 (controller/terminate.py), within --sigterm-dump-timeout-s of the first."""
        with self.lock:
            if self.grace_deadline is None and not self.state.terminating:
                self.grace_deadline = time.monotonic() + self.cfg.sigterm_dump_timeout_s
            self.events.emit("terminate_requested", reason=reason, timeout_s=self.cfg.sigterm_dump_timeout_s)
            self.apply(sm.TerminateRequested(reason))

    def check_recovered(self) -> None:
        """After a restart: once every rank is back at the step the fault hit, log the recovery."""
        if self.state.phase is not sm.JobPhase.RUNNING:
            return
        fields = self.timing.check_recovered(self.workers.values(), self.state.attempt, time.monotonic())
        if fields is not None:
            self.events.emit("recovered", **fields)

    # -- the hang monitor --------------------------------------------------------------------
    def _monitor_loop(self) -> None:
        while not self.done.wait(MONITOR_INTERVAL_S):
            self._check_nodes(time.monotonic())
            with self.lock:
                now = time.monotonic()
                if self.state.phase is sm.JobPhase.RUNNING:
                    self._check_after_loop(now)
                if self.state.phase is sm.JobPhase.RUNNING and not self.state.hung_ranks:
                    self._check_hangs(now)
                elif self.state.phase is sm.JobPhase.RECOVERING:
                    self._check_recovery_silence(now)
                if self.grace_deadline is not None and now > self.grace_deadline:
                    self.grace_deadline = None
                    self.apply(sm.GraceExpired(self.cfg.sigterm_dump_timeout_s))
                if self.recovery_deadline and now > self.recovery_deadline[1]:
                    gen, self.recovery_deadline = self.recovery_deadline[0], None
                    self.events.emit("recovery_timeout", gen=gen, timeout_s=self.cfg.worker.recovery_timeout_s)
                    self.apply(sm.RecoveryTimeout(self.state.attempt, gen))

    def _check_nodes(self, now: float) -> None:
        """Heartbeats to every agent, and silent agents declared lost (controller/liveness.py): their
        connection is closed, so the thread serving it reports the node lost. Sent outside the lock:
        a send into a cut link may block on a full socket buffer."""
        with self.lock:
            silent = self.liveness.silent(now)
            beat = self.liveness.beat_due(now)
            agents = dict(self.connections.agents)
            for agent, silent_s in silent:
                self.liveness.forget(agent)
                self.events.emit("agent_silent", node_rank=agent, silent_s=round(silent_s, 3),
                                 timeout_s=self.cfg.node_timeout_s)
        for agent, _ in silent:
            if agent in agents:
                agents.pop(agent).close()
        if beat:
            for conn in agents.values():
                try:
                    conn.send(Heartbeat(rank=-1))  # -1: from the controller
                except OSError:
                    pass  # (ConnectionClosed too) the thread serving it reports the loss

    def _check_hangs(self, now: float) -> None:
        """Some rank is past its hang timeout: blame the one not progressing (hangs.py)."""
        found = self.monitor.find_hung(self.workers.values(), self.state.attempt, now)
        if found is not None:
            blamed, why = found
            w = self.workers[blamed.rank]
            # The hang began when its progress stopped, not when we noticed.
            self.timing.fault_began(w.last_progress_t, self.workers.values())
            self._hung(w, blamed, why, during="step")

    def _check_after_loop(self, now: float) -> None:
        """A rank past its loop whose process stays stopped is hung there (hangs.hung_after_loop):
        it is killed and counts as finished (loop_end.py), each rank once."""
        blamed = self.monitor.find_hung_after_loop(self.workers.values(), self.state.attempt, now,
                                                   killed=self.state.hung_after_loop)
        if blamed is not None:
            self._hung(self.workers[blamed.rank], blamed, f"its process is {blamed.process} after its step loop",
                       during="after-loop")

    def _check_recovery_silence(self, now: float) -> None:
        """A survivor that does not answer the abort order within its hang timeout is hung too."""
        rec, ordered_t, hung = self.state.recovery, self.timing.decided_t, self.state.hung_ranks
        if rec is None or rec.regrouped or ordered_t is None:
            return
        blamed = self.monitor.find_silent_in_recovery(self.workers.values(), self.state.attempt, rec, ordered_t, now)
        if blamed is not None and blamed.rank not in hung and hung <= rec.replaced:
            why = f"no answer to the abort of generation {rec.gen}; process {blamed.process}"
            self._hung(self.workers[blamed.rank], blamed, why, during="recovery")

    def _hung(self, w: WorkerView, blamed: RankProgress, why: str, during: str) -> None:
        self.events.emit("hang_detected", rank=w.rank, step=w.step, phase=w.phase, silent_s=round(blamed.silent_s, 3),
                         timeout_s=round(blamed.timeout_s, 3), median_step_s=self.monitor.median_step_s(),
                         attempt=w.attempt, process=w.process, why=why, during=during)
        self.apply(sm.WorkerHung(w.rank, w.attempt, w.step, blamed.silent_s))
