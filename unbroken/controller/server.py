"""The controller: one per job, inside node 0's agent process (threads, no subprocess).

:class:`Controller` is the hub: it owns the job state of the pure state machine
(:func:`unbroken.controller.machine.transition`), the lock that guards everything, and the
pieces that each do one job:

* :class:`~unbroken.controller.board.Board` -- the one owner of what the pieces share and
  change: each rank's view, the agents' connections, claimed faults, deadlines, the outcome;
* :class:`~unbroken.controller.connections.Connections` -- the control-plane connections:
  messages in (a message-type -> handler table), turned into events; they send nothing;
* :class:`~unbroken.controller.executor.Executor` -- actions out, as messages: it alone sends
  (it opens each attempt's rendezvous store);
* :class:`~unbroken.controller.store_service.StoreService` -- the rendezvous store the workers
  use, served over the control plane (its own lock; one table per attempt);
* :class:`~unbroken.controller.watchdog.Watchdog` -- step times, the hang and straggler rules
  (who a hang is blamed on: :mod:`unbroken.controller.hangs`);
* :class:`~unbroken.controller.timing.RecoveryTiming` -- how long each recovery took;
* :class:`~unbroken.controller.summaries.NodeSummaries` -- the nodes' summaries of their steady steps
  (setting node_summaries: the commit record, the job step and the ranks heard, from them);
* the event log (``events.jsonl``) and the storage tier the persisted steps commit into.

Whoever builds a controller may hand it step listeners (:meth:`Controller.add_step_listener`, and
:meth:`Controller.add_job_step_listener` for the job steps the summaries tell): the launcher gives it
the live view of :mod:`unbroken.ops.live_view`, which it knows nothing of.

Threads: one per control connection (the protocol server's), one watchdog. All state is
guarded by :attr:`Controller.lock`; actions are carried out under it (they only send small
messages).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from unbroken.checkpoint.launch_dirs import run_id
from unbroken.checkpoint.storage import StorageTier
from unbroken.config import LaunchConfig
from unbroken.controller import health, machine as sm
from unbroken.controller.board import Board
from unbroken.controller.connections import Connections
from unbroken.controller.durable_mirror import layout_key
from unbroken.controller.eventlog import EventLog
from unbroken.controller.executor import Executor
from unbroken.controller.hangs import NOT_RUNNING, RankProgress
from unbroken.controller.hub import Reply, TellAgents
from unbroken.controller.liveness import Liveness
from unbroken.controller.rank_state import RankStates
from unbroken.controller.store_service import StoreService
from unbroken.controller.summaries import NodeSummaries
from unbroken.controller import takeover as tk
from unbroken.controller.timing import RecoveryTiming
from unbroken.controller.values import RankSet
from unbroken.controller.views import Outcome, RankView
from unbroken.controller.watchdog import WATCH_INTERVAL_S, Watchdog
from unbroken.protocol import messages as m
from unbroken.protocol.messages import PER_RANK_LIMIT_BYTES, Heartbeat
from unbroken.protocol.wire import Server

__all__ = ["Controller", "Outcome", "RankView", "WATCH_INTERVAL_S", "StepListener"]

#: Under node summaries: how long a suspected hang waits for the agents' held reports, and after how long a
#: suspicion that outlived them asks again.
FLUSH_WAIT_S = 0.2
FLUSH_AGAIN_S = 2.0
#: Told of each completed step: (rank, steps completed, the step's metrics as the rank reported them).
StepListener = Callable[[int, int, dict], None]
JobStepListener = Callable[[int, dict], None]  # (steps every rank completed, the slowest's step_s and ckpt_s)
#: Told of each new state whose durable part (attempt, generation, committed step, budget, placement,
#: the replica layout, an end) changed; called under the lock: it must only hand the state on.
DurableListener = Callable[[sm.JobState], None]


#: Told of each step this controller commits, at the moment it commits it (under the lock): the
#: ``step_committed`` record of its event log (term, attempt, gen, step, t). --controller-store only.
CommitListener = Callable[[dict], None]


def _durable_key(state: sm.JobState) -> tuple:
    return layout_key(state), state.committed_step


class Controller:
    """One job's controller (see the module docstring). Public API: :meth:`start`,
    :meth:`wait`, :meth:`abort`, :meth:`close`, :meth:`snapshot`, :attr:`first_failure`,
    :meth:`add_step_listener`."""

    def __init__(self, cfg: LaunchConfig, *, host: str, port: int, events: EventLog,
                 takeover: tk.Takeover | None = None, term_valid: Callable[[], bool] | None = None,
                 term: int = 0) -> None:
        self.cfg = cfg
        self.host = host
        self.events = events
        self.lock = threading.RLock()
        ckpt = cfg.checkpoint  # a scale-out fetches snapshots from a peer agent's memory (controller/elastic.py)
        self._state = sm.JobState(cfg.recovery, world_size=cfg.world_size, nnodes=cfg.nnodes,
                                  can_dump=bool(ckpt.save_dir),
                                  snapshot_every=ckpt.every_steps if ckpt.peer_memory and cfg.job_id else 0)
        # A controller taking over from a lost leader (controller/takeover.py): the job restarts from
        # the state the last leader left; its node's agents are not let back in.
        self._takeover = takeover
        self._join_deadline: float | None = None
        if takeover is not None:
            self._state = tk.resumed(self._state, takeover.durable)
        self._fenced = ""  # why this controller stopped acting ("": it acts)
        # --controller-store: whether this controller's leadership term still holds, asked before
        # each event (a clock check, no etcd call): past it, another controller may lead already.
        self._term_valid = term_valid
        self._term = term  # the leadership term it acts for (0: no --controller-store)
        self._commit_listeners: list[CommitListener] = []
        self._durable_listeners: list[DurableListener] = []
        self._durable_seen: tuple = ()
        self.board = Board(cfg.world_size, cfg.nnodes)
        self._grace_deadline: float | None = None  # monotonic end of the SIGTERM dump (--sigterm-dump-timeout-s)
        self._step_listeners: list[StepListener] = []
        self._job_step_listeners: list[JobStepListener] = []
        self.summaries = NodeSummaries()  # the nodes' summaries of their steady steps (setting node_summaries)
        self._flush_asked_t: float | None = None  # when a suspected hang made it ask the agents for held reports
        ckpt = cfg.checkpoint
        self.storage = StorageTier(ckpt.save_dir, keep=ckpt.keep, run_id=run_id(cfg.secret, cfg.job_id)) \
            if ckpt.save_dir else None
        self.timing = RecoveryTiming()
        self._watchdog = Watchdog(cfg.hang, cfg.straggler_factor)
        self.rank_states = RankStates(PER_RANK_LIMIT_BYTES)  # each rank's own state, for its replacement
        self.liveness = Liveness(cfg.node_timeout_s)  # heartbeats: silent nodes are lost (liveness.py)
        self.store_service = StoreService()
        self._connections = Connections(self)
        self._executor = Executor(self)
        self._server = Server(host, port, cfg.secret.encode(), self._connections.serve,
                              on_failed_handshakes=lambda count, last: self.events.emit(
                                  "handshakes_failed", count=count, last=last))
        self._watch_thread = threading.Thread(target=self._watch_loop, name="unbroken-watchdog", daemon=True)

    @property
    def state(self) -> sm.JobState:
        """The state machine's state (immutable; replaced only by :meth:`apply`)."""
        return self._state

    def add_step_listener(self, listener: StepListener) -> None:
        """Tell ``listener`` of each completed step (before :meth:`start`; called under the lock, so it
        must be quick and take no lock that waits for this one)."""
        self._step_listeners.append(listener)

    def add_job_step_listener(self, listener: JobStepListener) -> None:
        """Tell ``listener`` of each job step the nodes' summaries say every rank completed (setting
        node_summaries: no rank's own report comes then; called under the lock, like the step listeners)."""
        self._job_step_listeners.append(listener)

    def add_durable_listener(self, listener: DurableListener) -> None:
        """Tell ``listener`` of each state whose durable part changed (before :meth:`start`)."""
        self._durable_listeners.append(listener)

    def add_commit_listener(self, listener: CommitListener) -> None:
        """Log each step commit (``step_committed``) and tell ``listener`` of it (before :meth:`start`)."""
        self._commit_listeners.append(listener)

    def step_committed(self, gen: int, step: int) -> None:
        """The executor commits ``step``: the commit log's entry (with commit listeners only); under the lock."""
        if self._commit_listeners:
            record = self.events.emit("step_committed", term=self._term, attempt=self._state.attempt, gen=gen,
                                      step=step)
            for listener in self._commit_listeners:
                listener(record)

    @property
    def port(self) -> int:
        return self._server.port

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> None:
        self._server.start()
        self._watch_thread.start()
        self.events.emit("controller_started", address=self.address, world_size=self.cfg.world_size,
                         nnodes=self.cfg.nnodes, max_restarts=self.cfg.recovery.max_restarts,
                         recover_strategy=list(self.cfg.recovery.allowed))
        if self._takeover is not None:
            with self.lock:
                self._start_takeover(self._takeover)

    def _start_takeover(self, takeover: tk.Takeover) -> None:
        """Log the takeover and time it as a recovery: ``recovered`` once every rank is back at the
        step after the last one committed."""
        durable, now = takeover.durable, time.monotonic()
        self.timing.fault_t, self.timing.fault_step = now, durable.committed_step + 1
        self._join_deadline = now + self.cfg.node_timeout_s
        self.events.emit("controller_takeover", previous=takeover.previous, lost_agents=sorted(takeover.lost),
                         attempt=self._state.attempt, committed_step=durable.committed_step,
                         generation=durable.generation, restarts_left=durable.restart_budget,
                         join_window_s=self.cfg.node_timeout_s)
        self._notice_durable()

    def refused(self, node_rank: int, standby: bool) -> str:
        """Why an agent may not join ("": it may): a node lost with the previous controller."""
        if self._takeover is None or standby or node_rank not in self._takeover.lost:
            return ""
        return (f"node {node_rank} was lost with the previous controller ({self._takeover.previous}); its ranks "
                "moved to a standby agent, and it does not rejoin this job")

    def fence(self, reason: str) -> None:
        """This controller's leadership ended (--controller-store): stop acting at once. No event
        is applied and nothing is sent any more; the control connections close, so the agents and
        workers find the new leader. Any thread (the lease's keepalive thread calls it)."""
        with self.lock:
            if self._fenced:
                return
            self._fenced = reason
            self.events.emit("controller_fenced", reason=reason, term=self._term)
        self.board.close()
        self.store_service.close()
        self._server.close()

    def _term_over(self) -> bool:
        """True (and the controller fenced, its connections closed by a thread of its own) when its
        leadership term has ended; under the lock."""
        if self._term_valid is None or self._term_valid():
            return False
        threading.Thread(target=self.fence, args=("leadership term over: its lease was not refreshed within --controller-lease-s; another "
                                      "controller may lead now",),
                         name="unbroken-controller-fence", daemon=True).start()
        return True

    @property
    def fenced(self) -> str:
        return self._fenced

    def wait(self, timeout_s: float | None = None) -> Outcome | None:
        self.board.wait(timeout_s)
        return self.board.outcome

    def abort(self, reason: str, exit_code: int = 130) -> None:
        """Stop the job from outside (Ctrl-C): every agent stops its workers."""
        with self.lock:
            self._executor.execute([sm.StopAttempt(self._state.attempt, reason), sm.Finish(exit_code, reason)])

    def close(self, drain_s: float = 10.0) -> None:
        """Stop serving; first let the agents finish (their last reports, e.g. a checkpoint
        persisted at the end of the job, are still taken in)."""
        self.board.close()
        deadline = time.monotonic() + drain_s
        while self.board.agent_ids() and time.monotonic() < deadline:
            time.sleep(0.02)
        self.store_service.close()
        self._server.close()
        self._executor.close()

    # -- views for status and the demo ---------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {
                "phase": self.state.phase.value,
                "attempt": self.state.attempt,
                "restarts_used": self.state.restarts_used,
                "median_step_s": self._watchdog.median_step_s(),
                "workers": [
                    {"rank": w.rank, "pid": w.pid, "step": w.step, "phase": w.phase, "state": w.state,
                     "metrics": dict(w.metrics)} for w in self.board.views()],
            }

    @property
    def first_failure(self) -> sm.Failure | None:
        with self.lock:
            return self.state.first_failure

    def hang_timeout_s(self, w: RankView) -> float:
        return self._watchdog.hang_timeout_s(w)

    # -- shared by the pieces (under the lock) ----------------------------------------------
    def apply(self, event: sm.Event) -> None:
        """One event through the pure state machine; its actions carried out at once. A fenced
        controller applies nothing: another one leads the job."""
        if self._fenced or self._term_over():
            return
        self._state, actions = sm.transition(self._state, event)
        if self._takeover is not None and self._state.phase is sm.JobPhase.STARTING:
            self._state, more = tk.place(self._state, self._takeover.lost)
            actions = [*actions, *more]
        self._executor.execute(actions)
        self._notice_durable()

    def _notice_durable(self) -> None:
        key = _durable_key(self._state)
        if key != self._durable_seen:
            self._durable_seen = key
            for listener in self._durable_listeners:
                listener(self._state)

    def reply(self, action: Reply | TellAgents) -> None:
        """A connection's direct answer, sent by the executor."""
        self._executor.execute([action])

    def step_completed(self, rank: int, attempt: int, step: int, metrics: dict, t: float | None = None) -> None:
        """``rank`` completed ``step`` steps (reported at ``t``, else now): the progress the watchdog watches,
        the listeners' step, a recovery's end, and (on rank 0's report) the straggler rule."""
        took = self.board.step_done(rank, step, metrics, time.monotonic() if t is None else t)
        if took is not None:
            self._watchdog.note_step_s(took)
        reported = self.board.view(rank).metrics
        for listener in self._step_listeners:
            listener(rank, step, reported)
        self.check_recovered()
        if rank == 0:
            for slow, why in self._watchdog.new_stragglers(self.board.views()):
                self.degraded(slow, attempt, why)

    def degraded(self, rank: int, attempt: int, reason: str) -> None:
        """A rank reported (or found) degraded: log it; the state machine applies the policy."""
        step = self.board.view(rank).step
        if self.cfg.recovery.sub_health_policy == "grace-exit":
            self.timing.fault_began(time.monotonic(), self.board.views())
        self.events.emit("sub_health", rank=rank, reason=reason, step=step, policy=self.cfg.recovery.sub_health_policy)
        self.apply(sm.RankDegraded(rank, attempt, reason, step))

    def terminate(self, reason: str) -> None:
        """An agent got SIGTERM: the job dumps its newest committed step where it can, then stops
        with exit code 143 (controller/terminate.py), within --sigterm-dump-timeout-s of the first."""
        with self.lock:
            if self._grace_deadline is None and not self._state.terminating:
                self._grace_deadline = time.monotonic() + self.cfg.sigterm_dump_timeout_s
            self.events.emit("terminate_requested", reason=reason, timeout_s=self.cfg.sigterm_dump_timeout_s)
            self.apply(sm.TerminateRequested(reason))

    def check_recovered(self) -> None:
        """After a restart: once every rank is back at the step the fault hit, log the recovery."""
        if self._state.phase is not sm.JobPhase.RUNNING or not self.timing.pending or self._state.hung_ranks:
            # (every rank's report comes here: nothing per rank unless a recovery is being timed; and a hang
            # being handled has not been recovered from, whatever late step reports still come in)
            return
        views = [w for w in self.board.views() if w.rank < self._state.world_size]  # (fewer after rung elastic)
        found = self.timing.check_recovered(views, self._state.attempt, time.monotonic())
        if found is not None:
            self.events.emit(found[0], **found[1])

    # -- the watchdog --------------------------------------------------------------------
    def _watch_loop(self) -> None:
        while not self.board.wait(WATCH_INTERVAL_S):
            self._check_nodes(time.monotonic())
            with self.lock:
                now = time.monotonic()
                if self._state.phase is sm.JobPhase.RUNNING:
                    self._check_after_loop(now)
                self._take_summaries()
                if self._state.phase is sm.JobPhase.RUNNING and not self._state.hung_ranks:
                    self._check_hangs(now)
                elif self._state.phase is sm.JobPhase.RECOVERING:
                    self._check_recovery_silence(now)
                if self._join_deadline is not None and now > self._join_deadline:
                    self._join_over()
                if self._grace_deadline is not None and now > self._grace_deadline:
                    self._grace_deadline = None
                    self.apply(sm.GraceExpired(self.cfg.sigterm_dump_timeout_s))
                gen = self.board.recovery_expired(now)
                if gen is not None:
                    self.events.emit("recovery_timeout", gen=gen, timeout_s=self.cfg.worker.recovery_timeout_s)
                    self.apply(sm.RecoveryTimeout(self._state.attempt, gen))

    def _join_over(self) -> None:
        """The takeover's join window ended: hosts still missing are lost (controller/takeover.py)."""
        self._join_deadline = None
        if self._fenced or self._takeover is None or self._term_over():
            return
        self._state, actions = tk.window_over(self._state, self._takeover.lost, self.cfg.node_timeout_s)
        self._executor.execute(actions)
        self._notice_durable()

    def _check_nodes(self, now: float) -> None:
        """Heartbeats to every agent, and silent agents declared lost (controller/liveness.py): their
        connection is closed, so the thread serving it reports the node lost. Sent here, outside the
        lock, not by the executor: a send into a cut link may block on a full socket buffer."""
        with self.lock:
            silent = self.liveness.silent(now)
            beat = self.liveness.beat_due(now)
            agents = {a: conn for a in self.board.agent_ids() if (conn := self.board.agent_conn(a)) is not None}
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
        """Some rank is past its hang timeout: blame the one not progressing (hangs.py). Under node summaries
        a rank's silence may rest on its node's summaries only: the agents are first asked for the reports
        they hold, and the rule decides on those a moment later (a stopped process, seen by its agent, at once)."""
        if self.liveness.overdue(now, self._state.hosts()):  # a frozen or cut-off node: its loss, not a hang of
            return  # one of the ranks that wait for it (a rank waiting in an earlier step's collective looks behind)
        heard = self.summaries.heard(self._state.attempt, self._hosting()) if self.cfg.worker.node_summaries else {}
        found = self._watchdog.find_hung(self.board.views(), self._state.attempt, now, heard=heard)
        if found is None or not self.cfg.worker.node_summaries or found[0].process in NOT_RUNNING:
            self._flush_asked_t = None
        elif self._flush_asked_t is None or now - self._flush_asked_t > FLUSH_AGAIN_S:
            self._flush_asked_t = now
            self.reply(TellAgents(m.FlushReports()))
            return
        elif now - self._flush_asked_t < FLUSH_WAIT_S:
            return
        if found is not None:
            blamed, why = found
            w = self.board.view(blamed.rank)
            # The hang began when its progress stopped, not when we noticed.
            self.timing.fault_began(w.last_progress_t, self.board.views())
            self._hung(w, blamed, why, during="step")

    def _take_summaries(self) -> None:
        """What the nodes' summaries said since the last tick (setting node_summaries; controller/summaries.py):
        the commit record, the live view's job step, the step times and the straggler rule."""
        state = self._state
        steps = self.summaries.take(state.attempt, self._hosting())
        if steps is None:
            return
        if steps.step_s > 0:  # (no rank reported a step time: nothing to calibrate the hang timeouts with)
            self._watchdog.note_step_s(steps.step_s)
        if state.phase is sm.JobPhase.RUNNING and steps.done - 1 > state.committed_step:
            self.apply(sm.RanksSynced(RankSet.full(state.world_size), state.attempt, state.gen, steps.done - 1))
        for listener in self._job_step_listeners:
            listener(steps.done, {"step_s": steps.step_s, "ckpt_s": steps.ckpt_s})
        for rank, median_s, job_s in self.summaries.stragglers(state.attempt, self.cfg.straggler_factor):
            if self._watchdog.first_straggle(rank):
                self.degraded(rank, state.attempt, health.describe(median_s, job_s))

    def _hosting(self) -> Mapping[int, int]:
        state = self._state
        return self.summaries.hosting(state.placement, state.world_size, state.world_size // max(1, state.nnodes))

    def _check_after_loop(self, now: float) -> None:
        """A rank past its loop whose process stays stopped is hung there (hangs.hung_after_loop):
        it is killed and counts as finished (loop_end.py), each rank once."""
        if not self.board.any_finishing():
            return  # (each tick: one pass, where the rules below take several)
        blamed = self._watchdog.find_hung_after_loop(self.board.views(), self._state.attempt, now,
                                                   killed=self._state.hung_after_loop)
        if blamed is not None:
            self._hung(self.board.view(blamed.rank), blamed, f"its process is {blamed.process} after its step loop",
                       during="after-loop")
            return
        blamed = self._watchdog.find_lingering_after_loop(self.board.views(), self._state.attempt, now,
                                                        killed=self._state.hung_after_loop)
        if blamed is not None:
            why = (f"its process still runs {blamed.silent_s:.1f} s after every other rank exited "
                   f"(--exit-timeout-s {blamed.timeout_s:g})")
            self._hung(self.board.view(blamed.rank), blamed, why, during="after-loop")

    def _check_recovery_silence(self, now: float) -> None:
        """A survivor that does not answer the abort order within its hang timeout is hung too."""
        rec, ordered_t, hung = self._state.recovery, self.timing.decided_t, self._state.hung_ranks
        if rec is None or rec.regrouped or ordered_t is None:
            return
        blamed = self._watchdog.find_silent_in_recovery(self.board.views(), self._state.attempt, rec, ordered_t, now)
        if blamed is not None and blamed.rank not in hung and hung <= rec.replaced:
            why = f"no answer to the abort of generation {rec.gen}; process {blamed.process}"
            self._hung(self.board.view(blamed.rank), blamed, why, during="recovery")

    def _hung(self, w: RankView, blamed: RankProgress, why: str, during: str) -> None:
        self.events.emit("hang_detected", rank=w.rank, step=w.step, phase=w.phase, silent_s=round(blamed.silent_s, 3),
                         timeout_s=round(blamed.timeout_s, 3), median_step_s=self._watchdog.median_step_s(),
                         attempt=w.attempt, process=w.process, why=why, during=during)
        self.apply(sm.RankHung(w.rank, w.attempt, w.step, blamed.silent_s))
