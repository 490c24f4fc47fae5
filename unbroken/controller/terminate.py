"""Stopping a job on SIGTERM, with a dump first where one can be made: part of the pure state
machine (:func:`unbroken.controller.machine.transition` hands it the events :func:`covers` names).

Kubernetes (a pod deleted or evicted) and Slurm (`scancel`, the time limit) send SIGTERM, and
SIGKILL a grace period later. The first SIGTERM any agent gets becomes :class:`TerminateRequested`;
the job then stops with exit code 143 (restartable) after writing the newest committed step to
``--save``, so a restarted job (``--load`` the same directory) loses at most the step in flight::

    RUNNING, --save, every rank commits its steps through unbroken
        --> RECOVERING (rung `dump` with nobody replaced: every rank leaves the step in flight;
            the first uncommitted step's state is written to storage by every rank)
        --every rank dumped--> CommitDump, TERMINATED (143)
    a dump already under way (sub-health, a lost rank) --> it goes on; TERMINATED after it
    some ranks already finished their loop --> no dump; SUCCEEDED if the rest finish in time
    anything else (no --save, a plain torchrun script, between attempts, an in-flight recovery)
        --> TERMINATED at once, saying why
    during the dump: a rank fails or hangs, an agent is lost, a rank refuses the dump, the
        recovery deadline, or :class:`GraceExpired` (``--sigterm-dump-timeout-s``)
        --> TERMINATED without it. The files written so far have no manifest, so no restore
        ever takes them (a step is a checkpoint only once its manifest is written: storage.py)

The controller (server.py) turns the grace period into :class:`GraceExpired`; the agents turn a
second SIGTERM into an immediate stop (agent.py), which reaches this machine as a lost agent.
"""

from __future__ import annotations

import dataclasses
import signal

from unbroken.controller.api import (AbortGeneration, Action, CommitDump, Finish, JobPhase, JobState, Recovery,
                                     StopAttempt, Terminating)
from unbroken.controller.events import (AgentLost, Event, GraceExpired, RankExited, RecoveryTimeout, StepDumped,
                                        TerminateRequested, RankDamaged, RankDegraded, RankHung)
from unbroken.controller.values import RankSet
from unbroken.errors import EXIT_FATAL
from unbroken.names import Rung

#: `unbroken run`'s exit code after SIGTERM, with or without the dump: restartable (128 + 15).
EXIT_TERMINATED = 128 + signal.SIGTERM

_WHILE_TERMINATING = (RankExited, RankHung, AgentLost, RankDamaged, RankDegraded, StepDumped, RecoveryTimeout)


def covers(state: JobState, event: Event) -> bool:
    """Whether :func:`transition` decides this event (the machine decides every other one)."""
    if isinstance(event, (TerminateRequested, GraceExpired)):
        return True
    if not state.terminating or not isinstance(event, _WHILE_TERMINATING):
        return False
    if isinstance(event, RankExited) and event.exit_code == EXIT_FATAL and not event.signal:
        return False  # EXIT_FATAL fails the job (exit 97) even now: no restart can help it
    return not (isinstance(event, AgentLost) and event.node_rank not in state.hosts())  # a spare agent leaving


def transition(state: JobState, event: Event) -> tuple[JobState, list[Action]]:
    if isinstance(event, TerminateRequested):
        return _on_requested(state, event)
    if not state.terminating:  # a GraceExpired after the job stopped some other way
        return state, []
    if isinstance(event, GraceExpired):
        return _stop(state, f"the dump did not finish within {event.timeout_s:g} s (--sigterm-dump-timeout-s)")
    if getattr(event, "attempt", state.attempt) != state.attempt:
        return state, []  # a message of an attempt that is already gone
    if isinstance(event, StepDumped):
        return _on_step_dumped(state, event)
    if isinstance(event, RankExited):
        return _on_rank_exited(state, event)
    if isinstance(event, RecoveryTimeout):
        rec = state.recovery
        if rec is None or event.gen != rec.gen:
            return state, []
        return _stop(state, f"the dump of generation {rec.gen} passed its deadline (--recovery-timeout-s)")
    if isinstance(event, RankDegraded):
        return state, []
    what = {RankHung: "hung", AgentLost: "was lost with its agent", RankDamaged: "reported damaged state"}
    rank = getattr(event, "rank", getattr(event, "node_rank", -1))
    who = f"node {rank}" if isinstance(event, AgentLost) else f"rank {rank}"
    return _stop(state, f"{who} {what[type(event)]} during the dump")


def _on_requested(state: JobState, event: TerminateRequested) -> tuple[JobState, list[Action]]:
    if state.terminating:
        return state, []  # every agent of a deleted JobSet asks: the first one decides
    state = dataclasses.replace(state, terminating=event.reason)
    rec = state.recovery
    if state.phase is JobPhase.RECOVERING and rec is not None and rec.rung == Rung.DUMP:
        return state, [Terminating(True, "a dump is under way: the job stops after it instead of restarting")]
    if state.finished_ranks:
        return state, [Terminating(False, f"ranks {sorted(state.finished_ranks)} finished their loop already: no "
                                          "dump; the others may finish within --sigterm-dump-timeout-s")]
    why = _why_no_dump(state)
    if why:
        return _stop(state, why, log=True)
    gen = state.gen + 1
    reason = f"{event.reason}: every rank leaves the step in flight; the newest committed step is dumped to --save"
    state = dataclasses.replace(state, phase=JobPhase.RECOVERING, synced=RankSet(),
                                recovery=Recovery(Rung.DUMP, gen, frozenset(), state.policy.max_recovery_tries))
    return state, [Terminating(True, reason), AbortGeneration(gen, reason)]


def _why_no_dump(state: JobState) -> str:
    """Why the job cannot dump now ("": it can)."""
    if not state.can_dump:
        return "no --save DIR to dump to"
    if state.phase is not JobPhase.RUNNING:
        return f"the job was {state.phase.value} (between attempts or in a recovery), not at a step boundary"
    if state.ready != state.ranks:
        return (f"ranks {sorted(state.ranks - state.ready)} do not commit their steps through unbroken "
                "(job.steps() with job.all_reduce or ShardedOptimizer), so no step is known to be consistent")
    return ""


def _on_step_dumped(state: JobState, event: StepDumped) -> tuple[JobState, list[Action]]:
    rec = state.recovery
    if rec is None or rec.rung != Rung.DUMP or event.step != rec.dump_step:
        return state, []
    if event.error:
        return _stop(state, f"rank {event.rank} could not dump step {event.step}: {event.error}")
    rec = dataclasses.replace(rec, dumped=rec.dumped | set(event.ranks))
    if rec.dumped != state.ranks:
        return dataclasses.replace(state, recovery=rec), []
    state, actions = _stop(state, "", dumped=rec.dump_step)
    return state, [CommitDump(rec.dump_step), *actions]


def _on_rank_exited(state: JobState, event: RankExited) -> tuple[JobState, list[Action]]:
    if event.exit_code != 0:
        how = f"signal {event.signal}" if event.signal else f"exit code {event.exit_code}"
        return _stop(state, f"rank {event.rank} exited ({how}) during the dump")
    finished = state.finished_ranks | {event.rank}
    state = dataclasses.replace(state, finished_ranks=finished)
    if len(finished) < state.world_size:
        return state, []
    state = dataclasses.replace(state, phase=JobPhase.SUCCEEDED, recovery=None)
    return state, [Finish(0, f"all {state.world_size} ranks finished (after {state.terminating})")]


def _stop(state: JobState, why: str, *, dumped: int | None = None, log: bool = False) -> tuple[JobState, list[Action]]:
    """TERMINATED: every worker stops, every agent exits 143. ``dumped``: the step written."""
    if dumped is not None:
        outcome = f"the state at step {dumped} was dumped to --save (event dump_committed)"
    else:
        outcome = f"stopped without a dump: {why}; the newest complete checkpoint in --save stays the newest"
    reason = f"{state.terminating}; {outcome}"
    state = dataclasses.replace(state, phase=JobPhase.TERMINATED, recovery=None)
    actions: list[Action] = [Terminating(False, why)] if log else []
    return state, [*actions, StopAttempt(state.attempt, reason), Finish(EXIT_TERMINATED, reason)]
