"""The controller's job state machine: a pure function ``transition(state, event) -> (state, actions)``.

No sockets, no threads, no clocks: the controller's server turns messages and timers into
events, calls :func:`transition`, and carries out the returned actions. That keeps every
decision testable in milliseconds.

States of a job (:class:`JobPhase`)::

    STARTING --all agents joined--> RUNNING --a rank failed, rung 'exit'--> STOPPING
    STOPPING --all agents stopped their workers--> RUNNING (attempt + 1)
    RUNNING --every rank exited 0--> SUCCEEDED
    RUNNING --a rank that reported leaving its step loop dies--> RUNNING (it counts as finished,
        with a warning: see :mod:`unbroken.controller.loop_end`) --every rank finished--> SUCCEEDED
    RUNNING --a node lost, rung 'elastic'--> STOPPING (a smaller world: see unbroken.controller.elastic)
    RUNNING (shrunk) --a step committed, every node of the launch there again--> STOPPING (scale-out)
    RUNNING --a rank failed, rung 'recover-in-place'--> RECOVERING (generation + 1)
    RECOVERING --every survivor paused, every replacement joined--> (regroup sent)
    RECOVERING --every rank resumed--> RUNNING
    RECOVERING --another fault--> RECOVERING (next generation) | STOPPING (rung 'exit')
    RUNNING/STOPPING/RECOVERING --no rung left (restart budget spent)--> FAILED
    RUNNING/RECOVERING --a rank exited with EXIT_FATAL--> FAILED (no rung is tried; exit code 97)
    any --SIGTERM--> (a dump of the newest committed step, where possible) TERMINATED (exit code 143):
        see :mod:`unbroken.controller.terminate`

Which rung handles a fault, and why, is the ladder's (:func:`unbroken.recovery.ladder.choose`): the
machine gathers what it knows of the fault (:func:`_facts`) and carries out the decision.

Steps commit here too: a step is committed when every rank reported that its gradient
reduction finished (:class:`StepSynced`); see :mod:`unbroken.recovery.consistency`.
"""

from __future__ import annotations

from unbroken.controller import commits, elastic, loop_end, terminate
from unbroken.controller.values import RankSet, replace
from unbroken.controller.api import (  # noqa: F401  (the nouns, re-exported for callers)
    JobPhase, Failure, ExitedAfterLoop, StartAttempt, StopAttempt, KillRank, Decide, Finish, CommitStep,
    AbortGeneration, RestartRanks, OrderRegroup, Recovered, DumpOrder, CommitDump, AnswerRestore, RestoreDecided,
    CommitPersisted, Recovery, RestoreRounds, JobPolicy, JobState, Action, FINAL_PHASES, Terminating, RecoveryHeld,
    Unconfirmed, ScaleOut, ScaleOutRefused, Shape)
from unbroken.controller.events import (  # noqa: F401  (the nouns, re-exported for callers)
    AgentJoined, RankExited, LoopFinished, RankHung, AgentStopped, AgentLost, StandbyJoined, SessionReady,
    StepSynced, RanksSynced, RankPaused, ReplacementJoined, RankResumed, RankDamaged, RankDegraded,
    StepDumped, RecoveryTimeout, RegroupRefused, RestoreOffered, StepPersisted, Event, TerminateRequested, GraceExpired)
from unbroken.errors import EXIT_FATAL
from unbroken.recovery.replicas import Replicas, job_replicas
from unbroken.recovery.consistency import InconsistentReports, Position, decide
from unbroken.recovery import crash_loop
from unbroken.recovery.ladder import GIVE_UP, RETRY_KINDS, Decision, FaultFacts, choose
from unbroken.names import REPLACING_RUNGS, Rung


def _replace(state: JobState, **changes) -> JobState:
    return replace(state, **changes)


def transition(state: JobState, event: Event) -> tuple[JobState, list[Action]]:
    """Apply one event to the job state; return the new state and what to do."""
    if isinstance(event, (RestoreOffered, StepPersisted)):  # in any phase: see unbroken.controller.commits
        state, actions = commits.transition(state, event)
        return elastic.check_restore(state, actions)  # a scale-out's ranks with no state: back to the shrunk shape
    if state.phase in FINAL_PHASES:
        return state, []
    if terminate.covers(state, event):  # SIGTERM: a dump where one can be made, then exit 143
        return terminate.transition(state, event)
    if isinstance(event, AgentJoined):
        return _on_agent_joined(state, event)
    if isinstance(event, RankHung):
        if loop_end.covers_hang(state, event):  # past its loop: killed, counted as finished (loop_end.py)
            return loop_end.on_hung_after_loop(state, event)
        return _on_rank_hung(state, event)
    if isinstance(event, RankExited):
        return _on_rank_exited(state, event)
    if isinstance(event, AgentStopped):
        return _on_agent_stopped(state, event)
    if isinstance(event, StandbyJoined):
        state = _replace(state, standbys=state.standbys | {event.agent}, no_grow=state.no_grow - {event.agent})
        return state, elastic.on_joined(state, event.agent)
    if isinstance(event, AgentLost):
        return _on_agent_lost(state, event)
    if getattr(event, "attempt", state.attempt) != state.attempt:
        return state, []  # a message of an attempt that is already gone
    if isinstance(event, LoopFinished):
        return loop_end.on_loop_finished(state, event)
    if isinstance(event, SessionReady):
        blockers = state.not_in_flight + (((event.rank, event.not_in_flight),) if event.not_in_flight else ())
        not_exact = state.not_exact + (((event.rank, event.not_exact),) if event.not_exact else ())
        return _replace(state, ready=state.ready.with_rank(event.rank), num_replicas=event.num_replicas,
                        not_in_flight=blockers, not_exact=not_exact,
                        mesh=tuple(zip(event.mesh_names, event.mesh_sizes)),
                        mesh_replicate=event.mesh_replicate), []
    if isinstance(event, (StepSynced, RanksSynced)):
        return _on_step_synced(state, event)
    if isinstance(event, RankDamaged):
        rec = state.recovery
        if rec is not None and rec.rung == Rung.RETRY and not rec.regrouped and event.kind in RETRY_KINDS:
            # Found by a second rank before the regroup: it receives its state from replicas too.
            return _replace(state, recovery=replace(rec, replaced=rec.replaced | {event.rank})), []
        if state.phase is not JobPhase.RUNNING:
            return state, [KillRank(event.rank, f"state damaged during a recovery: {event.what}")]
        kind = event.kind if event.kind in RETRY_KINDS else "memory-fault"
        return _recover(state, Failure(rank=event.rank, attempt=event.attempt, kind=kind, step=event.step))
    if isinstance(event, StepDumped):
        return _on_step_dumped(state, event)
    if isinstance(event, RankDegraded):
        return _on_rank_degraded(state, event)
    if isinstance(event, (RankPaused, ReplacementJoined, RankResumed, RecoveryTimeout, RegroupRefused)):
        return _on_recovery_event(state, event)
    raise TypeError(f"unknown event {event!r}")


def _on_rank_hung(state: JobState, event: RankHung) -> tuple[JobState, list[Action]]:
    """Kill a hung rank; its exit then takes the ladder. While running: one hang-kill at a
    time (the ranks blocked on the hung one in a collective look hung too, but fail by
    themselves: gloo sees the kill in milliseconds). During a recovery: a survivor that did
    not answer the abort order (pause) is hung itself, once the ranks killed before are out."""
    rec = state.recovery
    if event.attempt != state.attempt:
        return state, []
    if state.phase is JobPhase.RUNNING and not state.hung_ranks:
        reason = f"rank {event.rank} made no step progress for {event.silent_s:.1f} s"
    elif (state.phase is JobPhase.RECOVERING and rec is not None and not rec.regrouped
          and event.rank not in rec.replaced | rec.paused | state.hung_ranks and state.hung_ranks <= rec.replaced):
        reason = f"rank {event.rank} did not answer the abort of generation {rec.gen} for {event.silent_s:.1f} s"
    else:
        return state, []
    return _replace(state, hung_ranks=state.hung_ranks | {event.rank}), [KillRank(event.rank, reason)]


def _on_agent_joined(state: JobState, event: AgentJoined) -> tuple[JobState, list[Action]]:
    state = _replace(state, agents=state.agents | {event.node_rank}, no_grow=state.no_grow - {event.node_rank})
    if state.phase is JobPhase.STARTING and state.hosts() <= state.agents:
        return _replace(state, phase=JobPhase.RUNNING), [StartAttempt(state.attempt)]
    return state, elastic.on_joined(state, event.node_rank)  # a shrunk job grows back at a commit (elastic.grow)


def _on_rank_exited(state: JobState, event: RankExited) -> tuple[JobState, list[Action]]:
    if event.attempt != state.attempt or state.phase not in (JobPhase.RUNNING, JobPhase.RECOVERING):
        return state, []  # a worker of an attempt that is already being stopped
    if event.exit_code == 0 and state.phase is JobPhase.RECOVERING:
        return state, []  # cannot happen in a step loop; the recovery deadline covers it
    if loop_end.covers(state, event):  # it had finished its loop: a warning, not a failure
        return loop_end.on_exit_after_loop(state, event)
    if event.exit_code == 0:
        return loop_end.finished(state, event.rank)
    kind = "hang" if event.rank in state.hung_ranks else ("crash" if event.signal else "exit")
    if event.exit_code == EXIT_FATAL and not event.signal:
        kind = "fatal"
    failure = Failure(rank=event.rank, attempt=event.attempt, kind=kind, exit_code=event.exit_code,
                      signal=event.signal, step=event.step, last_lines=event.last_lines, gen=state.gen)
    return _recover(state, failure)  # EXIT_FATAL and a crash loop included: the ladder says no rung helps


def _facts(state: JobState, failure: Failure, lost: frozenset[int] = frozenset(), detail: str = "") -> FaultFacts:
    """What the ladder is told of a failure (``lost``: further ranks lost with it)."""
    rec = state.recovery
    prior = state.unconfirmed if rec is None else None  # a recovery that finished but has not held
    failed = lost | {failure.rank}
    dead = (rec.replaced if rec else frozenset()) | failed
    return FaultFacts(
        rank=failure.rank, kind=failure.kind, what=failure.describe(), world_size=state.world_size,
        storage=state.can_dump, dead=dead, last_lines=failure.last_lines,
        detail=detail, replicas=_replica_map(state), not_ready=tuple(sorted(state.ranks - state.ready)),
        not_in_flight=state.not_in_flight, left_loop=tuple(sorted((state.loop_finished | state.finished_ranks) - dead)),
        recovering=rec.rung if rec else "", tries=rec.tries + 1 if rec else (prior.tries + 1 if prior else 1),
        recurring_step=prior.resume_step if prior else None,
        home_agents_up={state.agent_of(r) for r in failed} <= state.agents, standby=bool(state.standbys),
        standbys=len(state.standbys), lost_agents=tuple(sorted(state.hosts() - state.agents)),
        restarts_used=state.restarts_used,
        repeats=crash_loop.repeats(state.failures + (failure,)),
        nodes_left=len(state.hosts() & state.agents), mesh=state.mesh, mesh_replicate=state.mesh_replicate,
        num_replicas=state.num_replicas, not_exact=state.not_exact)


def _replica_map(state: JobState) -> Replicas:
    """Who holds what: the job's mesh (replicas along its replicate dimension), else the flat
    data-parallel layout of ``num_replicas`` (0: full replication)."""
    return job_replicas(state.world_size, state.num_replicas, state.mesh, state.mesh_replicate)


def _recover(state: JobState, failure: Failure, lost: frozenset[int] = frozenset()) -> tuple[JobState, list[Action]]:
    """Ask the ladder for a failure's rung (``lost``: further ranks lost with it) and start it."""
    growing = state.growing
    if growing is not None and not (state.hosts() - state.agents) - growing.joining:
        # The attempt that grows the job back failed before it restored: back to the shrunk shape (its
        # ranks' own snapshots are there), without the agents it took in.
        state = _replace(state, first_failure=state.first_failure or failure, failures=state.failures + (failure,))
        return elastic.undo_grow(state, failure.describe())
    facts = _facts(state, failure, lost)
    decision = choose(facts, state.policy)
    rung, reason, recovery = decision.rung, decision.reason, state.recovery
    state = _replace(state, first_failure=state.first_failure or failure, failures=state.failures + (failure,))
    if decision.kill:  # not repairable in place: the damaged process goes, and its exit takes the ladder on
        return state, [Decide(rung, failure, reason), KillRank(failure.rank, decision.kill)]
    if rung == Rung.RETRY:  # no process exits: the damaged rank receives its state from replicas
        gen = state.gen + 1
        state = _replace(state, phase=JobPhase.RECOVERING, synced=RankSet(),
                         recovery=Recovery(rung, gen, frozenset({failure.rank}), facts.tries))
        return state, [Decide(rung, failure, reason), AbortGeneration(gen, reason)]
    if rung == Rung.DUMP:  # survivors write one consistent copy from replicas, then the job restarts
        gen = (recovery.gen if recovery else state.gen) + 1
        state = _replace(state, phase=JobPhase.RECOVERING, synced=RankSet(),
                         recovery=Recovery(rung, gen, facts.dead, facts.tries))
        return state, [Decide(rung, failure, reason), AbortGeneration(gen, reason)]
    if rung in REPLACING_RUNGS:
        return _replace_ranks(state, failure, decision, facts, lost | {failure.rank})
    if rung == Rung.ELASTIC:  # no standby for a lost node: a job restart on the nodes left, smaller
        return elastic.shrink(state, failure, decision, facts)
    if state.recovery is not None:
        state = _replace(state, recovery=None)
    if rung == GIVE_UP:
        return _fail(state, failure, reason, exit_code=decision.exit_code)
    stop = StopAttempt(state.attempt, f"{rung}: {failure.describe()}")
    state = _onto_standbys(state)
    # restore_ranks=(): every rank restores its own snapshots again (a shrink's renumbering is past)
    return _replace(state, phase=JobPhase.STOPPING, stopped_agents=frozenset(), restore_ranks=(), fetch_from=(),
                    growing=None), [Decide(rung, failure, reason), stop]


def _onto_standbys(state: JobState) -> JobState:
    """A job restart with agents lost: each lost agent's ranks move to a standby agent (the lowest
    first), which starts them in the next attempt (their memory-tier snapshots come from the peer
    copies: agent/peer_memory.py). The ladder took rung exit only if there are enough standbys."""
    lost = sorted(state.hosts() - state.agents)
    if not lost:
        return state
    moved = dict(zip(lost, sorted(state.standbys)))
    placement = tuple(moved.get(state.agent_of(r), state.agent_of(r)) for r in range(state.world_size))
    spares = frozenset(moved.values())
    return _replace(state, placement=placement, standbys=state.standbys - spares, agents=state.agents | spares)


def _replace_ranks(state: JobState, failure: Failure, decision: Decision, facts: FaultFacts,
                   failed: frozenset[int]) -> tuple[JobState, list[Action]]:
    """Rungs recover-in-place and recover: new processes for the dead ranks, on their own agents or a spare."""
    rung, recovery = decision.rung, state.recovery
    gen = (recovery.gen if recovery else state.gen) + 1
    placement = tuple(state.agent_of(r) for r in range(state.world_size))
    restarts: list[Action] = []
    if rung == Rung.RECOVER:  # the failed ranks move to a spare agent
        spare = min(state.standbys)
        placement = tuple(spare if r in failed else a for r, a in enumerate(placement))
        state = _replace(state, standbys=state.standbys - {spare}, agents=state.agents | {spare})
        restarts.append(RestartRanks(failed, gen, spare))
    else:
        for agent in sorted({state.agent_of(r) for r in failed}):
            restarts.append(RestartRanks(frozenset(r for r in failed if state.agent_of(r) == agent), gen, agent))
    state = _replace(state, phase=JobPhase.RECOVERING, synced=RankSet(), placement=placement,
                     recovery=Recovery(rung, gen, facts.dead, facts.tries))
    return state, [Decide(rung, failure, decision.reason), AbortGeneration(gen, decision.reason), *restarts]


def _fail(state: JobState, failure: Failure, why: str, exit_code: int = 1) -> tuple[JobState, list[Action]]:
    """The job fails: exit code 1 (restartable by a cluster manager), or EXIT_FATAL (97: never)."""
    state = _replace(state, phase=JobPhase.FAILED, first_failure=state.first_failure or failure)
    root = state.first_failure.describe() if state.first_failure.rank >= 0 else why
    return state, [Decide(GIVE_UP, failure, why), StopAttempt(state.attempt, why),
                   Finish(exit_code, f"{why}; root cause: {root}")]


def _on_agent_stopped(state: JobState, event: AgentStopped) -> tuple[JobState, list[Action]]:
    if state.phase is not JobPhase.STOPPING or event.attempt != state.attempt:
        return state, []
    stopped = state.stopped_agents | {event.node_rank}
    if not state.hosts() <= stopped:
        return _replace(state, stopped_agents=stopped), []
    attempt = state.attempt + 1
    state = _replace(state, phase=JobPhase.RUNNING, attempt=attempt, restarts_used=state.restarts_used + 1,
                     stopped_agents=frozenset(), finished_ranks=RankSet(), loop_finished=RankSet(),
                     exited_after_loop=RankSet(), hung_after_loop=RankSet(), hung_ranks=frozenset(),
                     gen=0, committed_step=-1, sync_step=-1, synced=RankSet(), ready=RankSet(),
                     not_in_flight=(), not_exact=(), mesh=(), mesh_replicate="", recovery=None, unconfirmed=None)
    return state, [StartAttempt(attempt)]


def _writers(state: JobState, rec: Recovery) -> tuple[tuple[int, int], ...]:
    """For each lost rank, the survivor holding an identical copy of its state (the lowest)."""
    replicas = _replica_map(state)
    alive = frozenset(state.ranks - rec.replaced)
    pairs = []
    for rank in sorted(rec.replaced):
        holders = [set(replicas.holders(p)) & alive for p in replicas.pieces_of(rank)]
        pairs.append((rank, min(set.intersection(*holders))))
    return tuple(pairs)


def _on_step_dumped(state: JobState, event: StepDumped) -> tuple[JobState, list[Action]]:
    rec = state.recovery
    if rec is None or rec.rung != Rung.DUMP or event.step != rec.dump_step:
        return state, []
    failure = Failure(rank=min(rec.replaced), attempt=state.attempt, kind="crash") if rec.replaced \
        else state.failures[-1]  # a sub-health dump: the degraded rank's report
    if event.error:  # no consistent copy: nothing is committed, the job restarts from the newest one
        state = _replace(state, recovery=replace(rec, tries=state.policy.max_recovery_tries, rung=Rung.DUMP))
        state, actions = _recover(state, replace(failure, kind="dump-failed"))
        return state, [Decide(Rung.DUMP, failure, f"dump refused by rank {event.rank}: {event.error}"), *actions]
    rec = replace(rec, dumped=rec.dumped | set(event.ranks))
    if rec.dumped != state.ranks:
        return _replace(state, recovery=rec), []
    state = _replace(state, recovery=replace(rec, tries=state.policy.max_recovery_tries))
    kind = "dumped" if rec.replaced else "sub-health-dumped"
    state, actions = _recover(state, replace(failure, kind=kind, step=rec.dump_step))
    return state, [CommitDump(rec.dump_step), *actions]


def _subject(state: JobState, rec: Recovery) -> int:
    """The rank a recovery is about: the lowest replaced one, or the degraded one (a sub-health dump)."""
    return min(rec.replaced) if rec.replaced else state.failures[-1].rank


def _on_rank_degraded(state: JobState, event: RankDegraded) -> tuple[JobState, list[Action]]:
    """Sub-health under ``--sub-health-policy grace-exit``: no process is lost, so every rank
    dumps its own state at the decided step (rung `dump` with nobody replaced), then the job
    restarts cleanly from it. Without a storage tier, a clean restart from the memory tier."""
    if state.policy.sub_health_policy != "grace-exit" or state.phase is not JobPhase.RUNNING or state.recovery:
        return state, []
    failure = Failure(rank=event.rank, attempt=event.attempt, kind="sub-health", step=event.step)
    decision = choose(_facts(state, failure, detail=event.reason), state.policy)
    state = _replace(state, first_failure=state.first_failure or failure, failures=state.failures + (failure,))
    if decision.rung == GIVE_UP:  # no restart left: the degraded rank trains on
        return state, [Decide(GIVE_UP, failure, decision.reason)]
    if decision.rung == Rung.DUMP:
        gen = state.gen + 1
        state = _replace(state, phase=JobPhase.RECOVERING, synced=RankSet(),
                         recovery=Recovery(Rung.DUMP, gen, frozenset(), state.policy.max_recovery_tries))
        return state, [Decide(Rung.DUMP, failure, decision.reason), AbortGeneration(gen, decision.reason)]
    return _replace(state, phase=JobPhase.STOPPING, stopped_agents=frozenset(), restore_ranks=(), fetch_from=()), [
        Decide(decision.rung, failure, decision.reason), StopAttempt(state.attempt, f"exit: {failure.describe()}")]


def _on_agent_lost(state: JobState, event: AgentLost) -> tuple[JobState, list[Action]]:
    """An agent's connection is gone: its node (and every rank on it) is lost."""
    agent = event.node_rank
    state = _replace(state, agents=state.agents - {agent}, standbys=state.standbys - {agent})
    ranks = frozenset(r for r in range(state.world_size) if state.agent_of(r) == agent)
    if not ranks:
        return state, []
    first = min(ranks)
    step = event.last_steps[first] if first < len(event.last_steps) else None
    failure = Failure(rank=first, attempt=state.attempt, kind="node-lost", step=step)
    if state.phase is JobPhase.STOPPING and state.growing is not None and agent in state.growing.joining:
        return elastic.undo_grow(state, failure.describe())  # lost while the scale-out stopped the attempt
    if state.phase in (JobPhase.STARTING, JobPhase.STOPPING):
        return _fail(state, failure, f"the agent of node {agent} was lost")
    return _recover(state, failure, lost=ranks)


def _on_step_synced(state: JobState, event: StepSynced | RanksSynced) -> tuple[JobState, list[Action]]:
    if state.phase is not JobPhase.RUNNING or event.gen != state.gen or event.step <= state.committed_step:
        return state, []
    synced = state.synced if event.step == state.sync_step else RankSet()
    synced = synced | event.ranks if isinstance(event, RanksSynced) else synced.with_rank(event.rank)
    if len(synced) < state.world_size:
        return _replace(state, sync_step=event.step, synced=synced), []
    # Every rank finished the reduction of this step: it commits, atomically with fault handling.
    actions: list[Action] = [CommitStep(state.gen, event.step)]
    held = state.unconfirmed
    if held is not None and event.step > held.resume_step:  # every rank completed the resumed step
        actions.append(RecoveryHeld(held.gen, held.resume_step))
        held = None
    state = _replace(state, sync_step=event.step, synced=RankSet(), committed_step=event.step, unconfirmed=held)
    state, grown = elastic.grow(state)  # a shrunk job grows back at a committed step, once it can
    return state, actions + grown


def _on_recovery_event(state: JobState, event: Event) -> tuple[JobState, list[Action]]:
    rec = state.recovery
    if state.phase is not JobPhase.RECOVERING or rec is None:
        return state, []
    if isinstance(event, RecoveryTimeout):
        if event.gen != rec.gen:
            return state, []
        failure = Failure(rank=_subject(state, rec), attempt=state.attempt, kind="recovery-timeout")
        state = _replace(state, recovery=Recovery(rec.rung, rec.gen, rec.replaced, state.policy.max_recovery_tries))
        return _recover(state, failure)
    if isinstance(event, RegroupRefused):
        return _refuse_in_flight(state, rec, event.why) if event.gen == rec.gen else (state, [])
    if isinstance(event, RankPaused) and event.cut_in_tail and event.rank not in rec.replaced:
        return _refuse_in_flight(state, rec, (
            f"rank {event.rank} was cut inside a reduction after its update of step {event.step}, and the script "
            "changes state after such reductions (an optimizer update, a tracked object): a roll forward would "
            "miss that"))
    if isinstance(event, RankPaused) and event.rank not in rec.replaced:
        rec = replace(rec, paused=rec.paused.with_rank(event.rank),
                      positions=rec.positions.push((event.rank, event.step, event.phase, event.cut)))
    elif isinstance(event, ReplacementJoined) and event.rank in rec.replaced:
        rec = replace(rec, joined=rec.joined.with_rank(event.rank))
    elif isinstance(event, RankResumed) and event.gen == rec.gen and rec.regrouped:
        rec = replace(rec, resumed=rec.resumed.with_rank(event.rank))
        if rec.resumed == state.ranks:
            state = _replace(state, phase=JobPhase.RUNNING, gen=rec.gen, recovery=None, synced=RankSet(),
                             hung_ranks=frozenset(),
                             unconfirmed=Unconfirmed(rec.gen, state.committed_step + 1, rec.tries))
            return state, [Recovered(rec.gen, state.committed_step + 1, rec.replaced)]
        return _replace(state, recovery=rec), []
    else:
        return state, []
    needed = state.ranks - rec.replaced if rec.rung == Rung.DUMP else state.ranks  # a dump has no replacements
    if not rec.regrouped and (rec.paused | rec.joined) >= needed:
        survivors: dict[int, Position] = {}
        cuts: dict[int, str | None] = {}
        for rank, step, phase, cut in rec.positions:  # newest first: a rank's latest pause counts
            if rank in rec.paused and rank not in survivors:
                survivors[rank], cuts[rank] = Position(step, phase), cut
        try:
            decision = decide(state.committed_step, survivors)
        except (InconsistentReports, ValueError) as exc:  # a bug, never a normal fault: restart the job
            return _refuse_in_flight(state, rec, f"inconsistent survivor reports: {exc}")
        voted = decision.resume_step - 1 > state.committed_step  # a survivor passed a vote the record lacks
        behind = {r: cuts[r] for r, pos in survivors.items()
                  if cuts[r] is not None and pos.step == decision.resume_step - 1}
        if behind and (rec.rung == Rung.DUMP or any(behind.values())):
            return _refuse_in_flight(state, rec, _why_not_behind(behind, decision.resume_step - 1, rec.rung))
        state = _replace(state, committed_step=decision.resume_step - 1)
        rec = replace(rec, regrouped=True)
        if rec.rung == Rung.DUMP:
            rec = replace(rec, dump_step=decision.resume_step)
            dump = DumpOrder(rec.gen, decision.resume_step, _writers(state, rec), voted)
            return _replace(state, recovery=rec), [dump]
        return _replace(state, recovery=rec), [OrderRegroup(rec.gen, decision.resume_step, rec.replaced,
                                                       decision.direction.value, decision.reason, voted,
                                                       frozenset(behind))]
    return _replace(state, recovery=rec), []


def _why_not_behind(behind: dict[int, str | None], step: int, rung: str) -> str:
    """Why survivors cut inside the reduction of step ``step``, which a peer updated, cannot resume in flight."""
    ranks = sorted(behind)
    if rung == Rung.DUMP:
        return (f"ranks {ranks} were cut inside the reduction of step {step}, which a peer updated: they hold no "
                "copy of its result to dump")
    return "; ".join(f"rank {r} was cut inside the reduction of step {step}, which a peer updated, and its own "
                     f"state at the cut need not be its state after the step's compute: {why}"
                     for r, why in sorted(behind.items()) if why)


def _refuse_in_flight(state: JobState, rec: Recovery, why: str) -> tuple[JobState, list[Action]]:
    """The in-flight recovery cannot be exact: no more tries in flight, the ladder goes on (a restart)."""
    failure = Failure(rank=_subject(state, rec), attempt=state.attempt, kind="recovery-refused")
    state = _replace(state, recovery=replace(rec, tries=state.policy.max_recovery_tries))
    state, more = _recover(state, failure)
    return state, [Decide(Rung.RECOVER_IN_PLACE, failure, why), *more]
