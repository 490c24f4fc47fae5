"""Carrying out the state machine's actions: each action type has one method that turns it
into messages to agents or workers, event-log lines and timing marks.

Owned by the :class:`~unbroken.controller.server.Controller`; runs under its lock, in
whichever thread applied the event (actions only send small messages). At each attempt it
opens a fresh rendezvous (no stale key survives a restart): the attempt's table in the
store service, its random key prefix, handed to workers only over the control plane, and the
TCPStore that plain torchrun scripts use, which it owns (rendezvous.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from unbroken.controller import machine as sm, rendezvous
from unbroken.controller.hub import Hub
from unbroken.controller.rank_state import Found
from unbroken.protocol.framing import MAX_FRAME_BYTES
from unbroken.controller.views import Outcome
from unbroken.errors import CheckpointError
from unbroken.names import Phase, Rung, WorkerState
from unbroken.protocol import messages as m



#: The most per-rank state bytes one dump order carries (the rest of its frame is small).
DUMP_STATES_BYTES = MAX_FRAME_BYTES * 3 // 4


class Executor:
    """Actions -> messages (see the module docstring)."""

    def __init__(self, ctl: Hub) -> None:
        self._ctl = ctl
        self.store: dist.TCPStore | None = None
        self.store_prefix = ""  # the current attempt's rendezvous key prefix (rendezvous.py)
        self._table: dict[type, Callable[[Any], None]] = {
            sm.StartAttempt: self._start_attempt, sm.StopAttempt: self._stop_attempt, sm.KillRank: self._kill,
            sm.ExitedAfterLoop: self._exited_after_loop,
            sm.Decide: self._decide, sm.CommitStep: self._commit_step, sm.AbortGeneration: self._abort,
            sm.RestartRanks: self._restart_ranks, sm.OrderRegroup: self._regroup,
            sm.Recovered: self._recovered, sm.RecoveryHeld: self._recovery_held, sm.DumpOrder: self._dump, sm.CommitDump: self._commit_dump,
            sm.AnswerRestore: self._answer_restore, sm.RestoreDecided: self._restore_decided,
            sm.CommitPersisted: self._commit_persisted, sm.Finish: self._finish, sm.Terminating: self._terminating,
        }

    def execute(self, actions: list[sm.Action]) -> None:
        for action in actions:
            self._table[type(action)](action)

    def close(self) -> None:
        self.store = None

    # -- attempts and processes -------------------------------------------------------------
    def _start_attempt(self, action: sm.StartAttempt) -> None:
        ctl = self._ctl
        # A fresh rendezvous per attempt: no stale keys (FACTS.md: torchrun restarts); the
        # previous attempt's stores go: all its workers are dead. Managed workers use the
        # authenticated store service, under a prefix only the control plane hands out.
        ctl.store_service.open_attempt(action.attempt)
        self.store, self.store_prefix = rendezvous.open_store(ctl.host), rendezvous.new_prefix()
        for w in ctl.workers.values():
            w.state, w.steps_in_generation = WorkerState.STARTING, 0
        ctl.events.emit("attempt_started", attempt=action.attempt, store_port=self.store.port)
        for agent in sorted(ctl.state.hosts()):
            ranks = [r for r in range(ctl.cfg.world_size) if ctl.state.agent_of(r) == agent]
            ctl.connections.send_to_agent(agent, m.StartWorkers(
                attempt=action.attempt, store_host=ctl.host, store_port=self.store.port,
                store_prefix=self.store_prefix, world_size=ctl.cfg.world_size, ranks=ranks))

    def _stop_attempt(self, action: sm.StopAttempt) -> None:
        self._ctl.events.emit("stop_workers", attempt=action.attempt, reason=action.reason)
        self._ctl.connections.broadcast_agents(m.StopWorkers(attempt=action.attempt, reason=action.reason))

    def _kill(self, action: sm.KillRank) -> None:
        ctl = self._ctl
        w = ctl.workers[action.rank]
        ctl.events.emit("kill_worker", rank=action.rank, pid=w.pid, reason=action.reason)
        ctl.connections.send_to_agent(ctl.state.agent_of(action.rank),
                                      m.KillWorker(rank=action.rank, pid=w.pid, reason=action.reason))

    def _exited_after_loop(self, action: sm.ExitedAfterLoop) -> None:
        how = f"signal {action.signal}" if action.signal else f"exit code {action.exit_code}"
        what = (f"rank {action.rank} hung after its step loop and was killed ({how}) at the hang timeout: see its "
                "'hang_detected' event" if action.hung else
                f"rank {action.rank} exited abnormally ({how}) after it finished its step loop")
        self._ctl.events.emit("exited_after_loop", rank=action.rank, exit_code=action.exit_code, signal=action.signal,
                              step=action.step, hung=action.hung,
                              warning=f"{what}: counted as finished, nothing recovered")

    def _restart_ranks(self, action: sm.RestartRanks) -> None:
        ctl = self._ctl
        for rank in sorted(action.ranks):
            w = ctl.workers[rank]
            w.state, w.conn, w.pid = WorkerState.STARTING, None, 0
            ctl.events.emit("restart_worker", rank=rank, gen=action.gen, agent=action.agent)
            ctl.connections.send_to_agent(action.agent, m.RestartWorker(
                rank=rank, attempt=ctl.state.attempt, gen=action.gen, store_host=ctl.host,
                store_port=self.store.port if self.store else 0, store_prefix=self.store_prefix,
                world_size=ctl.cfg.world_size))

    def _terminating(self, action: sm.Terminating) -> None:
        ctl = self._ctl
        ctl.events.emit("terminating", dump=action.dump, reason=action.reason,
                        committed_step=_committed(ctl.state.committed_step),
                        timeout_s=ctl.cfg.sigterm_dump_timeout_s)

    def _finish(self, action: sm.Finish) -> None:
        ctl = self._ctl
        if ctl.outcome is not None:  # finished already (e.g. a second SIGTERM after the machine's Finish)
            return
        ctl.outcome = Outcome(action.exit_code, action.reason)
        counts = ctl.connections.counts
        ctl.events.emit("control_messages", received=dict(sorted(counts.received.items())),
                        sent=dict(sorted(counts.sent.items())),  # for benchmarks/commit.py
                        relayed=dict(sorted(counts.relayed.items())))
        ctl.events.emit("job_finished", exit_code=action.exit_code, reason=action.reason)
        ctl.connections.broadcast_agents(m.Shutdown(exit_code=action.exit_code, reason=action.reason))
        ctl.done.set()

    # -- decisions and in-flight recovery ------------------------------------------------------
    def _decide(self, action: sm.Decide) -> None:
        ctl = self._ctl
        f = action.failure
        ctl.events.emit("decision", rung=action.rung, rank=f.rank, kind=f.kind, step=f.step,
                        attempt=f.attempt, committed_step=_committed(ctl.state.committed_step), reason=action.reason)
        if action.rung != Rung.RECOVER_IN_PLACE:
            ctl.recovery_deadline = None

    def _commit_step(self, action: sm.CommitStep) -> None:
        for w in self._ctl.workers.values():  # every rank reported StepSynced: each moves on to its update
            if w.phase == Phase.SYNC:  # (ranks send no 'update' report of their own: worker/progress.py)
                w.phase = Phase.UPDATE
        self._ctl.connections.send_commit(action)  # the action is the wire message

    def _abort(self, action: sm.AbortGeneration) -> None:
        ctl = self._ctl
        now = time.monotonic()
        ctl.timing.decided(now)
        ctl.recovery_deadline = (action.gen, now + ctl.cfg.worker.recovery_timeout_s)
        ctl.events.emit("abort_generation", gen=action.gen)
        ctl.connections.send_to_workers(m.Abort(gen=action.gen, reason=action.reason,
                                                committed_step=ctl.state.committed_step))

    def _regroup(self, action: sm.OrderRegroup) -> None:
        ctl = self._ctl
        ctl.timing.mark("regroup", time.monotonic())
        ctl.events.emit("regroup", gen=action.gen, resume_step=action.resume_step,
                        replaced=sorted(action.replaced), direction=action.direction, reason=action.reason)
        replaced = sorted(action.replaced)
        found = self._own_states(replaced, action.resume_step)
        order = m.Regroup(gen=action.gen, resume_step=action.resume_step, replaced=replaced,
                          fallback=[r for r in replaced if found[r] is None])
        ctl.connections.send_to_workers(order, set(ctl.workers) - set(replaced))
        for r in replaced:  # each replaced rank's order carries its own per-rank state
            own = found[r]
            ctl.connections.send_to_workers(dataclasses.replace(order, rank_state=own.state) if own else order, {r})

    def _own_states(self, replaced: list[int], resume_step: int) -> dict[int, Found | None]:
        """Each replaced rank's own per-rank state for ``resume_step``, and an event saying where it
        comes from (a survivor's copy when the controller kept none)."""
        ctl = self._ctl
        found = {r: ctl.rank_states.for_resume(r, ctl.state.attempt, resume_step) for r in replaced}
        src = min(set(ctl.workers) - set(replaced), default=-1)
        for r, own in found.items():
            source = own.source if own else f"fallback: rank {src}'s copy (none of rank {r}'s own was kept)"
            ctl.events.emit("per_rank_state", rank=r, resume_step=resume_step, source=source)
        return found

    def _recovered(self, action: sm.Recovered) -> None:
        ctl = self._ctl
        now = time.monotonic()
        ctl.recovery_deadline = None
        for w in ctl.workers.values():  # paused ranks made no progress on purpose; the redo step is a first
            w.last_progress_t, w.steps_in_generation = now, 0  # step (new connections, a cold replacement): monitor.py
        fields = ctl.timing.recovered_in_flight(action.resume_step, now)
        ctl.events.emit("recovered_in_flight", gen=action.gen, resume_step=action.resume_step,
                        replaced=sorted(action.replaced), **fields)

    def _recovery_held(self, action: sm.RecoveryHeld) -> None:
        self._ctl.events.emit("recovery_held", gen=action.gen, resume_step=action.resume_step)

    # -- checkpoints: dump, persisted steps, restore decisions --------------------------------
    def _dump(self, action: sm.DumpOrder) -> None:
        ctl = self._ctl
        assign = [list(p) for p in action.assign]
        ctl.events.emit("dump", gen=action.gen, step=action.step, assign=assign)
        order = m.Dump(gen=action.gen, step=action.step, assign=assign)
        lost = {lost for lost, _ in action.assign}
        ctl.connections.send_to_workers(order, set(ctl.workers) - {writer for _, writer in action.assign} - lost)
        for writer in sorted({writer for _, writer in action.assign}):  # each gets the states it writes
            states = {}
            for rank in sorted(lost_rank for lost_rank, w in action.assign if w == writer):
                own = ctl.rank_states.for_resume(rank, ctl.state.attempt, action.step)
                if own is not None and sum(map(len, states.values())) + len(own.state) <= DUMP_STATES_BYTES:
                    states[str(rank)] = own.state
                ctl.events.emit("per_rank_state", rank=rank, resume_step=action.step, writer=writer,
                                source=own.source if str(rank) in states else "none: the dump writes the writer's copy")
            ctl.connections.send_to_workers(dataclasses.replace(order, states=states), {writer})

    def _commit_dump(self, action: sm.CommitDump) -> None:
        ctl = self._ctl
        try:
            ctl.storage.commit(action.step, ctl.cfg.world_size, {"dump": True})
            ctl.events.emit("dump_committed", step=action.step)
        except (CheckpointError, OSError, AttributeError) as exc:
            ctl.events.emit("dump_failed", step=action.step, error=str(exc))

    def _commit_persisted(self, action: sm.CommitPersisted) -> None:
        ctl = self._ctl
        try:
            ctl.storage.commit(action.step, ctl.cfg.world_size)
        except (CheckpointError, OSError) as exc:
            ctl.events.emit("persist_failed", step=action.step, error=str(exc))
            return
        ctl.events.emit("checkpoint_persisted", step=action.step, seconds=round(action.seconds, 4), tier="storage")

    def _answer_restore(self, action: sm.AnswerRestore) -> None:
        conn = self._ctl.workers[action.rank].conn
        if conn is not None:
            conn.send(m.RestoreAt(attempt=action.attempt, round=action.round, step=action.step))

    def _restore_decided(self, action: sm.RestoreDecided) -> None:
        point = action.point
        self._ctl.events.emit("restore_decided", attempt=action.attempt, round=action.round, step=point.step,
                              tier=point.tier, tiers=list(point.tiers), below=action.below, reason=point.reason)
        self._ctl.connections.send_to_workers(m.RestoreAt(attempt=action.attempt, round=action.round,
                                                          step=point.step))


def _committed(step: int) -> int | None:
    """The newest step committed through unbroken in this attempt; None (not -1) when none was,
    e.g. a script that does not commit through unbroken, whatever step it is at."""
    return step if step >= 0 else None
