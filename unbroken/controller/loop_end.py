"""The end of a job's training: ranks past their step loop, and deaths after it. Part of the
pure state machine (:func:`unbroken.controller.machine.transition` hands it these events).

A rank reports leaving its step loop (``job.steps()`` ended or the script broke out of it:
Progress phase ``finished``, :class:`LoopFinished`). Its training is done: every step it ran is
committed, and nothing of it is needed to train on. So when such a rank then dies, killed by a
signal or crashing at interpreter exit (a gloo group torn down late, a native library's
destructor), that is no failure to recover from: the rank counts as finished, the event log gets
a warning (:class:`ExitedAfterLoop`), and the job ends once every rank finished::

    RUNNING --rank r reports 'finished'--> RUNNING (r in loop_finished)
    RUNNING --r exits non-zero after it--> RUNNING (r finished, with a warning)
    RUNNING --the last rank finishes--> SUCCEEDED, exit code 0

A rank that dies *before* reporting it finished its loop is a failure, recovered as always
(machine.py). The exit code is 0 ("succeeded") when every rank finished its loop, whether or
not some exited abnormally afterwards: the training the job was asked for is complete.
"""

from __future__ import annotations

import dataclasses

from unbroken.controller.api import Action, ExitedAfterLoop, Finish, JobPhase, JobState
from unbroken.controller.events import LoopFinished, RankExited


def covers(state: JobState, event: RankExited) -> bool:
    """Whether a rank's exit is a death after its loop (decided here, not by the ladder)."""
    return (event.attempt == state.attempt and state.phase is JobPhase.RUNNING and event.exit_code != 0
            and event.rank in state.loop_finished)


def on_loop_finished(state: JobState, event: LoopFinished) -> tuple[JobState, list[Action]]:
    return dataclasses.replace(state, loop_finished=state.loop_finished | {event.rank}), []


def on_exit_after_loop(state: JobState, event: RankExited) -> tuple[JobState, list[Action]]:
    state = dataclasses.replace(state, exited_after_loop=state.exited_after_loop | {event.rank})
    return finished(state, event.rank, [ExitedAfterLoop(event.rank, event.exit_code, event.signal, event.step)])


def finished(state: JobState, rank: int, actions: list[Action] | None = None) -> tuple[JobState, list[Action]]:
    """``rank`` is done; the job succeeds once every rank is."""
    actions = actions or []
    done = state.finished_ranks | {rank}
    if len(done) < state.world_size:
        return dataclasses.replace(state, finished_ranks=done), actions
    why = f"all {state.world_size} ranks finished"
    if state.exited_after_loop:
        why += (f" their loops (ranks {sorted(state.exited_after_loop)} exited abnormally afterwards: see the "
                "'exited_after_loop' events)")
    return dataclasses.replace(state, finished_ranks=done, phase=JobPhase.SUCCEEDED), [*actions, Finish(0, why)]
