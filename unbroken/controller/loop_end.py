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

A rank past its loop can also hang there (stopped by SIGSTOP or a debugger during the script's
final save, ``job.close()``, ``destroy_process_group``): the hang monitor finds its process
stopped for longer than its hang timeout (:func:`unbroken.controller.hangs.hung_after_loop`) and
reports it hung (:class:`RankHung`); it is killed, and its exit is one after its loop::

    RUNNING --r (in loop_finished) hung--> RUNNING (r in hung_after_loop; KillRank r)
    RUNNING --r exits (killed)--> RUNNING (r finished, warned that it hung) --...--> SUCCEEDED

A rank that dies *before* reporting it finished its loop is a failure, recovered as always
(machine.py); once some other rank has left its loop, no survivor can redo a step in flight
(``FaultFacts.left_loop``, :func:`unbroken.recovery.ladder.in_flight_refusal`), so the ladder goes to a job
restart. The exit code is 0 ("succeeded")
when every rank finished its loop, whether or not some exited abnormally or hung afterwards:
the training the job was asked for is complete, every step of it committed.
"""

from __future__ import annotations

import dataclasses

from unbroken.controller.api import Action, ExitedAfterLoop, Finish, JobPhase, JobState, KillRank
from unbroken.controller.events import LoopFinished, RankExited, RankHung


def covers(state: JobState, event: RankExited) -> bool:
    """Whether a rank's exit is a death after its loop (decided here, not by the ladder)."""
    return (event.attempt == state.attempt and state.phase is JobPhase.RUNNING and event.exit_code != 0
            and event.rank in state.loop_finished)


def on_loop_finished(state: JobState, event: LoopFinished) -> tuple[JobState, list[Action]]:
    return dataclasses.replace(state, loop_finished=state.loop_finished | {event.rank}), []


def covers_hang(state: JobState, event: RankHung) -> bool:
    """Whether a hang is one after the rank's loop (decided here: a kill, never a recovery)."""
    return (event.attempt == state.attempt and state.phase is JobPhase.RUNNING and event.rank in state.loop_finished
            and event.rank not in state.finished_ranks)


def on_hung_after_loop(state: JobState, event: RankHung) -> tuple[JobState, list[Action]]:
    """Kill a rank that hangs after its loop (once); its exit then counts it as finished."""
    if event.rank in state.hung_after_loop:
        return state, []
    after = "" if event.step is None else f" (after step {event.step})"
    reason = (f"rank {event.rank} hung after its step loop{after} for {event.silent_s:.1f} s, in the script's code "
              "past job.steps() (its final save, job.close(), destroy_process_group); its training is done: killed, "
              "counted as finished")
    return dataclasses.replace(state, hung_after_loop=state.hung_after_loop | {event.rank}), [
        KillRank(event.rank, reason)]


def on_exit_after_loop(state: JobState, event: RankExited) -> tuple[JobState, list[Action]]:
    state = dataclasses.replace(state, exited_after_loop=state.exited_after_loop | {event.rank})
    warning = ExitedAfterLoop(event.rank, event.exit_code, event.signal, event.step,
                              hung=event.rank in state.hung_after_loop)
    return finished(state, event.rank, [warning])


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
    hung = sorted(state.hung_after_loop & state.exited_after_loop)
    if hung:
        who = f"rank {hung[0]} hung after its step loop" if len(hung) == 1 else \
            f"ranks {hung} hung after their step loops"
        why += (f"; {who} (no progress in the script's code after job.steps()) and was killed at the hang "
                "timeout: every step is committed, but what that code was to do (e.g. a final save) may be missing")
    return dataclasses.replace(state, finished_ranks=done, phase=JobPhase.SUCCEEDED), [*actions, Finish(0, why)]
