"""Carrying out actions, and all sending: each action type of the state machine has one method that
turns it into messages to agents or workers, event-log lines, timing marks and notes on the
controller's :class:`~unbroken.controller.board.Board`; so do the connections' direct answers
(:class:`~unbroken.controller.hub.Reply`, :class:`~unbroken.controller.hub.TellAgents`). Nothing
else in the controller sends on a control connection (the store service answers its own).

Owned by the :class:`~unbroken.controller.server.Controller`; runs under its lock, in
whichever thread applied the event (actions only send small messages). At each attempt it
opens a fresh rendezvous (no stale key survives a restart): the attempt's table in the
store service, its random key prefix, handed to workers only over the control plane, and the
TCPStore that plain torchrun scripts use, which it owns (rendezvous.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from unbroken.controller import elastic, machine as sm, rendezvous
from unbroken.controller.hub import Hub, Reply, TellAgents
from unbroken.controller.rank_state import Found
from unbroken.controller.views import Outcome
from unbroken.errors import CheckpointError, ProtocolError
from unbroken.names import LIVE_WORKER_STATES, Rung
from unbroken.protocol import messages as m
from unbroken.protocol.framing import MAX_FRAME_BYTES
from unbroken.protocol.wire import pack_frame

log = logging.getLogger(__name__)


#: The most per-rank state bytes one dump order carries (the rest of its frame is small).
DUMP_STATES_BYTES = MAX_FRAME_BYTES * 3 // 4


class Executor:
    """Actions -> messages (see the module docstring)."""

    def __init__(self, hub: Hub) -> None:
        self._hub = hub
        self.store: rendezvous.PlainStore | None = None
        self.store_prefix = ""  # the current attempt's rendezvous key prefix (rendezvous.py)
        self._table: dict[type, Callable[[Any], None]] = {
            sm.StartAttempt: self._start_attempt, sm.StopAttempt: self._stop_attempt, sm.KillRank: self._kill,
            sm.ExitedAfterLoop: self._exited_after_loop,
            sm.Decide: self._decide, sm.CommitStep: self._commit_step, sm.AbortGeneration: self._abort,
            sm.RestartRanks: self._restart_ranks, sm.OrderRegroup: self._regroup,
            sm.Recovered: self._recovered, sm.RecoveryHeld: self._recovery_held, sm.DumpOrder: self._dump, sm.CommitDump: self._commit_dump,
            sm.AnswerRestore: self._answer_restore, sm.RestoreDecided: self._restore_decided,
            sm.CommitPersisted: self._commit_persisted, sm.Finish: self._finish, sm.Terminating: self._terminating,
            sm.ScaleOut: self._scale_out, sm.ScaleOutRefused: self._scale_out_refused,
            Reply: self._reply, TellAgents: self._tell_agents,
        }

    def execute(self, actions: list[sm.Action]) -> None:
        for action in actions:
            self._table[type(action)](action)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        self.store = None

    # -- sending -----------------------------------------------------------------------------
    def send_to_agent(self, node: int, msg: m.Message) -> None:
        conn = self._hub.board.agent_conn(node)
        if conn is None:
            return
        try:
            conn.send(msg)
        except (OSError, ProtocolError) as exc:
            log.warning("controller: could not send %s to node %d: %s", type(msg).__name__, node, exc)

    def broadcast_agents(self, msg: m.Message) -> None:
        for node in self._hub.board.agent_ids():
            self.send_to_agent(node, msg)

    def send_to_workers(self, msg: m.Message, ranks: set[int] | None = None) -> None:
        """Send ``msg`` to every live worker (or those of ``ranks``) that has a connection (encoded once)."""
        try:
            data = pack_frame(m.encode(msg))
        except ProtocolError as exc:  # our own bug: logged, never a dead controller thread
            log.error("controller: could not encode %s for the workers: %s", type(msg).__name__, exc)
            return
        for w in self._hub.board.views():
            if w.conn is not None and w.state in LIVE_WORKER_STATES and (ranks is None or w.rank in ranks):
                try:
                    w.conn.send_packed(data)
                    self._hub.board.count_sent(type(msg).__name__)
                except (OSError, ProtocolError) as exc:
                    log.warning("controller: could not send %s to rank %d: %s", type(msg).__name__, w.rank, exc)

    def _reply(self, action: Reply) -> None:
        try:
            action.conn.send(action.msg)
        except (OSError, ProtocolError) as exc:
            log.warning("controller: could not answer %s with %s: %s", action.conn.peer, type(action.msg).__name__,
                        exc)

    def _tell_agents(self, action: TellAgents) -> None:
        if action.agent is None:
            self.broadcast_agents(action.msg)
        else:
            self.send_to_agent(action.agent, action.msg)

    # -- attempts and processes -------------------------------------------------------------
    def _start_attempt(self, action: sm.StartAttempt) -> None:
        hub = self._hub
        # A fresh rendezvous per attempt: no stale keys (FACTS.md: torchrun restarts); the
        # previous attempt's stores go: all its workers are dead. Managed workers use the
        # authenticated store service, under a prefix only the control plane hands out.
        hub.store_service.open_attempt(action.attempt)
        if self.store is not None:
            self.store.close()
        self.store, self.store_prefix = rendezvous.PlainStore(hub.host), rendezvous.new_prefix()
        hub.board.attempt_started()
        hub.events.emit("attempt_started", attempt=action.attempt, store_port=self.store.port)
        self._send_peer_book()  # first: an agent fetches its moved ranks' peer copies before it starts them
        state = hub.state
        for agent in sorted(state.hosts()):
            ranks = elastic.ranks_on(state, agent)
            self.send_to_agent(agent, m.StartRanks(
                attempt=action.attempt, store_host=hub.host, store_port=self.store.port,
                store_prefix=self.store_prefix, world_size=state.world_size, ranks=ranks,
                **_shrunk_shape(state, ranks)))

    def _stop_attempt(self, action: sm.StopAttempt) -> None:
        self._hub.events.emit("stop_ranks", attempt=action.attempt, reason=action.reason)
        self.broadcast_agents(m.StopRanks(attempt=action.attempt, reason=action.reason))

    def _kill(self, action: sm.KillRank) -> None:
        hub = self._hub
        w = hub.board.view(action.rank)
        hub.events.emit("kill_rank", rank=action.rank, pid=w.pid, reason=action.reason)
        self.send_to_agent(hub.state.agent_of(action.rank),
                                      m.KillRank(rank=action.rank, pid=w.pid, reason=action.reason))

    def _exited_after_loop(self, action: sm.ExitedAfterLoop) -> None:
        how = f"signal {action.signal}" if action.signal else f"exit code {action.exit_code}"
        what = (f"rank {action.rank} hung after its step loop and was killed ({how}) at the hang timeout: see its "
                "'hang_detected' event" if action.hung else
                f"rank {action.rank} exited abnormally ({how}) after it finished its step loop")
        self._hub.events.emit("exited_after_loop", rank=action.rank, exit_code=action.exit_code, signal=action.signal,
                              step=action.step, hung=action.hung,
                              warning=f"{what}: counted as finished, nothing recovered")

    def _send_peer_book(self) -> None:
        """Every agent's peer-memory address and the agents hosting ranks (agent/peer_memory.py): each
        agent sends its snapshots to the next hosting one, and fetches from any at a job restart."""
        hub = self._hub
        ids, hosts, ports, relays = [], [], [], []
        for agent in sorted(hub.board.agent_ids()):
            conn = hub.board.agent_conn(agent)
            if conn is None:
                continue
            ids.append(agent)
            hosts.append(str(getattr(conn, "peer", "")).rpartition(":")[0].strip("[]"))
            ident = dict(getattr(conn, "ident", {}) or {})
            ports.append(_port(ident.get("peer_port")))
            relays.append(_port(ident.get("relay_port")))  # the summary tree's (setting node_summaries)
        hosting = sorted(hub.state.hosts())
        book = {"agents": ids, "hosts": hosts, "ports": ports, "hosting": hosting,
                "relay_ports": relays if any(relays) else []}
        for agent in [a for a, port, relay in zip(ids, ports, relays) if port or relay]:  # the others need none
            self.send_to_agent(agent, m.PeerAgents(you=agent, **book))

    def _restart_ranks(self, action: sm.RestartRanks) -> None:
        hub = self._hub
        self._send_peer_book()  # the ring now runs through the agent that takes the ranks
        for rank in sorted(action.ranks):
            hub.board.restarting(rank)
            hub.events.emit("restart_rank", rank=rank, gen=action.gen, agent=action.agent)
            self.send_to_agent(action.agent, m.RestartRank(
                rank=rank, attempt=hub.state.attempt, gen=action.gen, store_host=hub.host,
                store_port=self.store.port if self.store else 0, store_prefix=self.store_prefix,
                world_size=hub.state.world_size, **_shrunk_rank(hub.state, rank)))

    def _terminating(self, action: sm.Terminating) -> None:
        hub = self._hub
        hub.events.emit("terminating", dump=action.dump, reason=action.reason,
                        committed_step=_committed(hub.state.committed_step),
                        timeout_s=hub.cfg.sigterm_dump_timeout_s)

    def _finish(self, action: sm.Finish) -> None:
        hub = self._hub
        if not hub.board.finish(Outcome(action.exit_code, action.reason)):
            return  # finished already (e.g. a second SIGTERM after the machine's Finish)
        counts = hub.board.counts
        hub.events.emit("control_messages", received=dict(sorted(counts.received.items())),
                        sent=dict(sorted(counts.sent.items())),  # for benchmarks/commit.py
                        relayed=dict(sorted(counts.relayed.items())))
        hub.events.emit("job_finished", exit_code=action.exit_code, reason=action.reason)
        self.broadcast_agents(m.Shutdown(exit_code=action.exit_code, reason=action.reason))
        hub.board.close()

    # -- decisions and in-flight recovery ------------------------------------------------------
    def _decide(self, action: sm.Decide) -> None:
        hub = self._hub
        f = action.failure
        hub.events.emit("decision", rung=action.rung, rank=f.rank, kind=f.kind, step=f.step,
                        attempt=f.attempt, committed_step=_committed(hub.state.committed_step), reason=action.reason)
        if action.rung != Rung.RECOVER_IN_PLACE:
            hub.board.recovery_dropped()

    def _scale_out(self, action: sm.ScaleOut) -> None:
        hub = self._hub
        hub.timing.scale_out_began(time.monotonic(), hub.board.views(), action.from_world, action.to_world)
        hub.events.emit("scale_out", from_world=action.from_world, to_world=action.to_world,
                        agents=list(action.agents), step=action.step, reason=action.reason)

    def _scale_out_refused(self, action: sm.ScaleOutRefused) -> None:
        hub = self._hub
        hub.timing.scale_out_dropped()
        hub.events.emit("scale_out_refused", world_size=action.world_size, agents=list(action.agents),
                        reason=action.reason)
        log.warning("controller: %s", action.reason)

    def _commit_step(self, action: sm.CommitStep) -> None:
        """The record of a step every rank reported reduced: nothing is sent, each rank passes the
        step's commit vote on its own (recovery/consistency.py)."""
        self._hub.step_committed(action.gen, action.step)  # the commit log

    def _abort(self, action: sm.AbortGeneration) -> None:
        hub = self._hub
        now = time.monotonic()
        hub.timing.decided(now)
        hub.board.recovery_ordered(action.gen, now + hub.cfg.worker.recovery_timeout_s)
        hub.events.emit("abort_generation", gen=action.gen)
        self.send_to_workers(m.Abort(gen=action.gen, reason=action.reason,
                                                committed_step=hub.state.committed_step))

    def _regroup(self, action: sm.OrderRegroup) -> None:
        hub = self._hub
        hub.timing.mark("regroup", time.monotonic())
        hub.events.emit("regroup", gen=action.gen, resume_step=action.resume_step, replaced=sorted(action.replaced),
                        direction=action.direction, reason=action.reason, voted=action.voted)
        replaced = sorted(action.replaced)
        src = min(hub.board.ranks() - set(replaced), default=-1)  # the survivor whose copy a fallback rank takes
        rec = hub.state.recovery  # rung retry: the replaced ranks are alive and keep their own state
        lost = [r for r in replaced if rec is None or rec.rung != Rung.RETRY]
        found = self._own_states(lost, action.resume_step, src, "in-flight recovery", action.gen)
        if found is None:
            return
        moved = hub.rank_states.moved_after_update
        if action.behind and moved is not None:  # their state at the cut is not what they would start with
            hub.apply(sm.RegroupRefused(action.gen, (
                f"no exact in-flight recovery at step {action.resume_step}: ranks {sorted(action.behind)} were cut "
                f"inside the reduction of step {action.resume_step - 1}, which a peer updated, and rank {moved[0]}'s "
                f"own state moved after its update of step {moved[1]}, so their state after compute need not be "
                f"what they start step {action.resume_step} with")))
            return
        if action.behind:
            hub.events.emit("behind", gen=action.gen, ranks=sorted(action.behind), step=action.resume_step - 1)
        missing = [r for r in lost if found[r] is None]
        order = m.Regroup(gen=action.gen, resume_step=action.resume_step, replaced=replaced, fallback=missing,
                          behind=sorted(action.behind))
        self.send_to_workers(order, hub.board.ranks() - set(replaced))
        for r in replaced:  # each replaced rank's order carries its own per-rank state
            own = found.get(r)
            self.send_to_workers(dataclasses.replace(order, rank_state=own.state) if own else order, {r})

    def _own_states(self, lost: list[int], resume_step: int, src: int, what: str,
                    gen: int) -> dict[int, Found | None] | None:
        """Each lost rank's own per-rank state for ``resume_step`` (None: rank ``src``'s copy stands in,
        byte-equal to the lost rank's at the newest point both reported), with an event saying where it
        comes from. Where a lost rank has neither, another rank's copy would not be exact: the order
        (``what``) is refused, the ladder goes on, and None is returned."""
        hub = self._hub
        found, sources, refused = {}, {}, []
        for r in lost:
            own = found[r] = hub.rank_states.for_resume(r, hub.state.attempt, resume_step)
            if own is not None:
                sources[r] = own.source
                continue
            equal_at = hub.rank_states.copy_matches(r, src, hub.state.attempt)
            if equal_at is None:
                refused.append(hub.rank_states.why_none(r, hub.state.attempt, resume_step))
            sources[r] = f"fallback: rank {src}'s copy (equal to rank {r}'s at the {equal_at})"
        if refused:
            hub.apply(sm.RegroupRefused(gen, (
                f"no exact {what} at step {resume_step}: {'; '.join(refused)}, and another rank's copy is not "
                f"known to be the same")))
            return None
        for r in lost:
            hub.events.emit("per_rank_state", rank=r, resume_step=resume_step, source=sources[r])
        return found

    def _recovered(self, action: sm.Recovered) -> None:
        hub = self._hub
        now = time.monotonic()
        hub.board.recovered(now)  # the redo step is a first step: the watchdog's first-step timeout
        fields = hub.timing.recovered_in_flight(action.resume_step, now)
        hub.events.emit("recovered_in_flight", gen=action.gen, resume_step=action.resume_step,
                        replaced=sorted(action.replaced), **fields)

    def _recovery_held(self, action: sm.RecoveryHeld) -> None:
        self._hub.events.emit("recovery_held", gen=action.gen, resume_step=action.resume_step)

    # -- checkpoints: dump, persisted steps, restore decisions --------------------------------
    def _dump(self, action: sm.DumpOrder) -> None:
        hub = self._hub
        assign = [list(p) for p in action.assign]
        lost = {lost for lost, _ in action.assign}
        writer_of = {lost_rank: writer for lost_rank, writer in action.assign}
        found: dict[int, Found | None] = {}
        for writer in sorted(set(writer_of.values())):
            mine = self._own_states(sorted(r for r, w in writer_of.items() if w == writer), action.step, writer,
                                    "dump", action.gen)
            if mine is None:
                return
            found.update(mine)
        states: dict[int, dict[str, bytes]] = {}  # per writer: the own states of the lost ranks it writes
        for rank, writer in sorted(writer_of.items()):
            own, mine = found[rank], states.setdefault(writer, {})
            if own is not None and sum(map(len, mine.values())) + len(own.state) > DUMP_STATES_BYTES:
                hub.apply(sm.RegroupRefused(action.gen, (
                    f"no exact dump at step {action.step}: the own states of the lost ranks rank {writer} "
                    f"writes are over {DUMP_STATES_BYTES} bytes together")))
                return
            if own is not None:
                mine[str(rank)] = own.state
        hub.events.emit("dump", gen=action.gen, step=action.step, assign=assign, voted=action.voted)
        order = m.Dump(gen=action.gen, step=action.step, assign=assign)
        self.send_to_workers(order, hub.board.ranks() - set(writer_of.values()) - lost)
        for writer, mine in sorted(states.items()):  # each gets the states it writes
            self.send_to_workers(dataclasses.replace(order, states=mine), {writer})

    def _commit_dump(self, action: sm.CommitDump) -> None:
        hub = self._hub
        try:
            hub.storage.commit(action.step, hub.state.world_size, {"dump": True})
            hub.events.emit("dump_committed", step=action.step)
        except (CheckpointError, OSError, AttributeError) as exc:
            hub.events.emit("dump_failed", step=action.step, error=str(exc))

    def _commit_persisted(self, action: sm.CommitPersisted) -> None:
        hub = self._hub
        try:
            hub.storage.commit(action.step, hub.state.world_size)
        except (CheckpointError, OSError) as exc:
            hub.events.emit("persist_failed", step=action.step, error=str(exc))
            return
        hub.events.emit("checkpoint_persisted", step=action.step, seconds=round(action.seconds, 4), tier="storage")

    def _answer_restore(self, action: sm.AnswerRestore) -> None:
        conn = self._hub.board.view(action.rank).conn
        if conn is not None:
            conn.send(m.RestoreAt(attempt=action.attempt, round=action.round, step=action.step))

    def _restore_decided(self, action: sm.RestoreDecided) -> None:
        point = action.point
        self._hub.events.emit("restore_decided", attempt=action.attempt, round=action.round, step=point.step,
                              tier=point.tier, tiers=list(point.tiers), below=action.below, reason=point.reason)
        self.send_to_workers(m.RestoreAt(attempt=action.attempt, round=action.round,
                                                          step=point.step))


def _committed(step: int) -> int | None:
    """The newest step committed through unbroken in this attempt; None (not -1) when none was,
    e.g. a script that does not commit through unbroken, whatever step it is at."""
    return step if step >= 0 else None


def _shrunk_shape(state: sm.JobState, ranks: list[int]) -> dict:
    """StartRanks' fields for ``ranks`` of one agent once rung elastic shrank the job, or grew it back
    (none before)."""
    if not (state.data_ranks or state.restore_ranks or state.fetch_from):
        return {}
    shape: dict = dict(local_ranks=list(range(len(ranks))),
                       restore_ranks=[state.restore_ranks[r] for r in ranks] if state.restore_ranks else [])
    if state.data_ranks:
        shape.update(data_ranks=[",".join(map(str, state.data_ranks[r])) for r in ranks],
                     data_world_size=state.data_world_size, lr_scale=state.lr_scale)
    if state.fetch_from:
        shape.update(fetch_agents=[state.fetch_from[r][0] for r in ranks],
                     fetch_ranks=[state.fetch_from[r][1] for r in ranks])
    return shape


def _shrunk_rank(state: sm.JobState, rank: int) -> dict:
    """RestartRank's fields for ``rank`` once rung elastic shrank the job (none before)."""
    if not state.data_ranks:
        return {}
    return dict(data_ranks=",".join(map(str, state.data_ranks[rank])), data_world_size=state.data_world_size,
                lr_scale=state.lr_scale)


def _port(value: object) -> int:
    """A port an agent said it listens on (its hello's ident), 0 if it said none or nonsense."""
    return value if type(value) is int and 0 < value < 65536 else 0
