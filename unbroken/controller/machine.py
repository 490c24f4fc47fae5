"""The controller's job state machine: a pure function ``transition(state, event) -> (state, actions)``.

No sockets, no threads, no clocks: the controller's server turns messages and timers into
events, calls :func:`transition`, and carries out the returned actions. That keeps every
decision testable in milliseconds.

States of a job (:class:`JobPhase`)::

    STARTING --all agents joined--> RUNNING --a rank failed, rung 'exit'--> STOPPING
    STOPPING --all agents stopped their workers--> RUNNING (attempt + 1)
    RUNNING --every rank exited 0--> SUCCEEDED
    RUNNING/STOPPING --no rung left (restart budget spent)--> FAILED
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

from unbroken.recovery.ladder import GIVE_UP, choose_rung


class JobPhase(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


@dataclass(frozen=True)
class Failure:
    """One failed rank: what happened, and where the job was."""

    rank: int
    attempt: int
    kind: str  # "crash" | "hang" | "exit"
    exit_code: int | None = None
    signal: int | None = None
    step: int | None = None
    last_lines: tuple[str, ...] = ()

    def describe(self) -> str:
        how = {"hang": "hung (no step progress) and was killed",
               "crash": "was killed by a signal" if self.signal else "crashed"}.get(self.kind, "exited")
        detail = f"signal {self.signal}" if self.signal else f"exit code {self.exit_code}"
        step = "before its first step" if self.step is None else f"at step {self.step}"
        return f"rank {self.rank} {how} ({detail}) {step}, attempt {self.attempt}"


# -- events ------------------------------------------------------------------------------
@dataclass(frozen=True)
class AgentJoined:
    node_rank: int


@dataclass(frozen=True)
class WorkerExited:
    rank: int
    attempt: int
    exit_code: int | None
    signal: int | None
    step: int | None = None
    last_lines: tuple[str, ...] = ()


@dataclass(frozen=True)
class WorkerHung:
    rank: int
    attempt: int
    step: int | None
    silent_s: float


@dataclass(frozen=True)
class AgentStopped:
    node_rank: int
    attempt: int


@dataclass(frozen=True)
class AgentLost:
    node_rank: int


Event = AgentJoined | WorkerExited | WorkerHung | AgentStopped | AgentLost


# -- actions -----------------------------------------------------------------------------
@dataclass(frozen=True)
class StartAttempt:
    attempt: int


@dataclass(frozen=True)
class StopAttempt:
    attempt: int
    reason: str


@dataclass(frozen=True)
class KillWorker:
    rank: int
    reason: str


@dataclass(frozen=True)
class Decide:
    """A recovery decision, for the event log."""

    rung: str
    failure: Failure
    reason: str


@dataclass(frozen=True)
class Finish:
    exit_code: int
    reason: str


Action = StartAttempt | StopAttempt | KillWorker | Decide | Finish


@dataclass(frozen=True)
class JobState:
    world_size: int
    nnodes: int
    max_restarts: int
    allowed: tuple[str, ...] = ("exit",)
    phase: JobPhase = JobPhase.STARTING
    attempt: int = 0
    restarts_used: int = 0
    agents: frozenset[int] = frozenset()
    stopped_agents: frozenset[int] = frozenset()
    finished_ranks: frozenset[int] = frozenset()
    hung_ranks: frozenset[int] = frozenset()
    first_failure: Failure | None = None
    failures: tuple[Failure, ...] = field(default_factory=tuple)


def _replace(state: JobState, **changes) -> JobState:
    return dataclasses.replace(state, **changes)


def transition(state: JobState, event: Event) -> tuple[JobState, list[Action]]:
    """Apply one event to the job state; return the new state and what to do."""
    if state.phase in (JobPhase.SUCCEEDED, JobPhase.FAILED):
        return state, []
    if isinstance(event, AgentJoined):
        return _on_agent_joined(state, event)
    if isinstance(event, WorkerHung):
        # One hang-kill at a time: the ranks blocked on the hung one in a collective look
        # hung too, but fail by themselves (gloo sees the kill in milliseconds).
        if event.attempt != state.attempt or state.phase is not JobPhase.RUNNING or state.hung_ranks:
            return state, []
        reason = f"rank {event.rank} made no step progress for {event.silent_s:.1f} s"
        return _replace(state, hung_ranks=state.hung_ranks | {event.rank}), [KillWorker(event.rank, reason)]
    if isinstance(event, WorkerExited):
        return _on_worker_exited(state, event)
    if isinstance(event, AgentStopped):
        return _on_agent_stopped(state, event)
    if isinstance(event, AgentLost):
        failure = Failure(rank=-1, attempt=state.attempt, kind="crash")
        return _fail(state, failure, f"the agent of node {event.node_rank} was lost")
    raise TypeError(f"unknown event {event!r}")


def _on_agent_joined(state: JobState, event: AgentJoined) -> tuple[JobState, list[Action]]:
    state = _replace(state, agents=state.agents | {event.node_rank})
    if state.phase is JobPhase.STARTING and len(state.agents) == state.nnodes:
        return _replace(state, phase=JobPhase.RUNNING), [StartAttempt(state.attempt)]
    return state, []


def _on_worker_exited(state: JobState, event: WorkerExited) -> tuple[JobState, list[Action]]:
    if event.attempt != state.attempt or state.phase is not JobPhase.RUNNING:
        return state, []  # a worker of an attempt that is already being stopped
    if event.exit_code == 0:
        finished = state.finished_ranks | {event.rank}
        if len(finished) == state.world_size:
            return _replace(state, finished_ranks=finished, phase=JobPhase.SUCCEEDED), [
                Finish(0, f"all {state.world_size} ranks finished")]
        return _replace(state, finished_ranks=finished), []
    kind = "hang" if event.rank in state.hung_ranks else ("crash" if event.signal else "exit")
    failure = Failure(rank=event.rank, attempt=event.attempt, kind=kind, exit_code=event.exit_code,
                      signal=event.signal, step=event.step, last_lines=event.last_lines)
    return _recover(state, failure)


def _recover(state: JobState, failure: Failure) -> tuple[JobState, list[Action]]:
    state = _replace(state, first_failure=state.first_failure or failure,
                     failures=state.failures + (failure,))
    feasible = {"exit": state.restarts_used < state.max_restarts}
    rung = choose_rung(state.allowed, feasible)
    if rung == GIVE_UP:
        return _fail(state, failure, f"restart budget spent ({state.restarts_used} of --max-restarts "
                                     f"{state.max_restarts} used)")
    decision = Decide(rung, failure, f"{failure.describe()}; restart {state.restarts_used + 1} "
                                     f"of {state.max_restarts}")
    stop = StopAttempt(state.attempt, f"{rung}: {failure.describe()}")
    return _replace(state, phase=JobPhase.STOPPING, stopped_agents=frozenset()), [decision, stop]


def _fail(state: JobState, failure: Failure, why: str) -> tuple[JobState, list[Action]]:
    state = _replace(state, phase=JobPhase.FAILED, first_failure=state.first_failure or failure)
    root = state.first_failure.describe() if state.first_failure.rank >= 0 else why
    return state, [Decide(GIVE_UP, failure, why), StopAttempt(state.attempt, why),
                   Finish(1, f"{why}; root cause: {root}")]


def _on_agent_stopped(state: JobState, event: AgentStopped) -> tuple[JobState, list[Action]]:
    if state.phase is not JobPhase.STOPPING or event.attempt != state.attempt:
        return state, []
    stopped = state.stopped_agents | {event.node_rank}
    if len(stopped) < state.nnodes:
        return _replace(state, stopped_agents=stopped), []
    attempt = state.attempt + 1
    state = _replace(state, phase=JobPhase.RUNNING, attempt=attempt, restarts_used=state.restarts_used + 1,
                     stopped_agents=frozenset(), finished_ranks=frozenset(), hung_ranks=frozenset())
    return state, [StartAttempt(attempt)]
