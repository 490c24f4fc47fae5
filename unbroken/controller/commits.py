"""The state machine's bookkeeping of commits outside the step loop: restore rounds at a
(re)start and steps persisted to storage by the agents. Pure, like :mod:`unbroken.controller.machine`
(which calls :func:`transition` for these events, in any job phase: a checkpoint persisted
at the end of the job still commits).

* **Restore rounds**: each rank offers the steps it can load (:class:`RestoreOffered`); once
  every rank offered for a round, the newest step committed for all, older than any decided
  in an earlier round of the attempt (some rank could not load that one), is decided
  (:class:`RestoreDecided`); a repeated offer gets the same answer (:class:`AnswerRestore`).
* **Persisted steps**: a step's storage files come from every node's agent
  (:class:`StepPersisted`); when every rank's are there the step is committed
  (:class:`CommitPersisted`) and older incomplete ones are dropped (never committed).
"""

from __future__ import annotations

import dataclasses

from unbroken.controller.api import AnswerRestore, CommitPersisted, JobState, RestoreDecided, RestoreRounds
from unbroken.controller.events import RestoreOffered, StepPersisted
from unbroken.recovery.restore_point import decide_restore


def transition(state: JobState, event: RestoreOffered | StepPersisted) -> tuple[JobState, list]:
    if isinstance(event, StepPersisted):
        return _on_step_persisted(state, event)
    return _on_restore_offered(state, event)


def _on_restore_offered(state: JobState, event: RestoreOffered) -> tuple[JobState, list]:
    if event.attempt != state.attempt:
        return state, []  # an offer of an attempt that is already gone
    rounds = state.restore if state.restore.attempt == event.attempt else RestoreRounds(event.attempt)
    decided = dict(rounds.decided)
    if event.round in decided:  # decided already (a repeated offer): answer again
        return dataclasses.replace(state, restore=rounds), [
            AnswerRestore(event.rank, event.attempt, event.round, decided[event.round])]
    offers = {(r, rank): offer for r, rank, offer in rounds.offers}
    offers[(event.round, event.rank)] = event.offer
    this_round = {rank: offer for (r, rank), offer in offers.items() if r == event.round}
    if len(this_round) < state.world_size:
        rounds = dataclasses.replace(rounds, offers=tuple((r, k, o) for (r, k), o in sorted(offers.items(),
                                                                                          key=lambda kv: kv[0])))
        return dataclasses.replace(state, restore=rounds), []
    below = min((step for r, step in rounds.decided if r < event.round), default=None)
    point = decide_restore(this_round, state.world_size, below=below)
    left = tuple((r, k, o) for (r, k), o in sorted(offers.items(), key=lambda kv: kv[0]) if r != event.round)
    rounds = RestoreRounds(event.attempt, left, rounds.decided + ((event.round, point.step),))
    return dataclasses.replace(state, restore=rounds), [RestoreDecided(event.attempt, event.round, point, below)]


def _on_step_persisted(state: JobState, event: StepPersisted) -> tuple[JobState, list]:
    done = dict(state.persisted)
    if event.error:  # that step will not be complete: forget it
        done.pop(event.step, None)
        return dataclasses.replace(state, persisted=tuple(sorted(done.items()))), []
    done[event.step] = done.get(event.step, frozenset()) | frozenset(event.ranks)
    if len(done[event.step]) < state.world_size:
        return dataclasses.replace(state, persisted=tuple(sorted(done.items()))), []
    left = {step: ranks for step, ranks in done.items() if step > event.step}  # older ones: superseded
    return dataclasses.replace(state, persisted=tuple(sorted(left.items()))), [CommitPersisted(event.step,
                                                                                               event.seconds)]
