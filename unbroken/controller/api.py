"""The controller's nouns: job phases, failures, the events it reacts to, the actions it
orders, and the job state its pure state machine (:mod:`unbroken.controller.machine`)
carries from one event to the next. All frozen dataclasses: no sockets, no threads.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from unbroken.names import Phase, Rung


class JobPhase(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    RECOVERING = "recovering"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


@dataclass(frozen=True)
class Failure:
    """One failed rank: what happened, and where the job was."""

    rank: int
    attempt: int
    kind: str  # "crash" | "hang" | "exit" | "fatal" (EXIT_FATAL) | ...: see describe()
    exit_code: int | None = None
    signal: int | None = None
    step: int | None = None
    last_lines: tuple[str, ...] = ()

    def describe(self) -> str:
        how = {"hang": "hung (no step progress) and was killed",
               "crash": "was killed by a signal" if self.signal else "crashed",
               "fatal": "exited with a fatal error (EXIT_FATAL: not restarted)",
               "node-lost": "was lost with its node's agent",
               "memory-fault": "reported state damaged in memory",
               "non-finite": "reported a non-finite loss or gradients",
               "sdc": "held state that differs from its replicas (silent data corruption)",
               "dump-failed": "was lost, and the dump of its state failed",
               "dumped": "was lost; the survivors dumped the job's state",
               "recovery-timeout": "was not recovered in time",
               "sub-health": "was reported degraded (sub-health)",
               "sub-health-dumped": "was reported degraded; the job's state was dumped for a clean restart",
               }.get(self.kind, "exited")
        detail = f" (signal {self.signal})" if self.signal else (
            f" (exit code {self.exit_code})" if self.exit_code is not None else "")
        step = "before its first step" if self.step is None else f"at step {self.step}"
        return f"rank {self.rank} {how}{detail} {step}, attempt {self.attempt}"


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


@dataclass(frozen=True)
class StandbyJoined:
    """A spare agent (`unbroken run --standby`) that can host replaced ranks (rung `recover`)."""

    agent: int


@dataclass(frozen=True)
class SessionReady:
    """A rank runs an unbroken step loop that can take part in in-flight recovery."""

    rank: int
    attempt: int
    num_replicas: int  # 0: full replication (every rank holds all state)


@dataclass(frozen=True)
class StepSynced:
    """A rank finished the gradient reduction of ``step`` and waits for its commit."""

    rank: int
    attempt: int
    gen: int
    step: int


@dataclass(frozen=True)
class WorkerPaused:
    """A survivor left the broken generation and waits for the regroup order."""

    rank: int
    attempt: int
    step: int
    phase: str = Phase.COMPUTE


@dataclass(frozen=True)
class ReplacementJoined:
    rank: int
    attempt: int
    gen: int


@dataclass(frozen=True)
class WorkerResumed:
    rank: int
    attempt: int
    gen: int


@dataclass(frozen=True)
class WorkerDegraded:
    """A live rank reports sub-health (``--sub-health-policy`` says what follows)."""

    rank: int
    attempt: int
    reason: str
    step: int | None = None


@dataclass(frozen=True)
class WorkerDamaged:
    """A live rank reports damaged state (kind: memory-fault, non-finite, sdc): rung `retry`."""

    rank: int
    attempt: int
    what: str
    kind: str = "memory-fault"
    step: int | None = None


@dataclass(frozen=True)
class StepDumped:
    """A survivor wrote the files of ``ranks`` for the dump of ``step`` (``error``: it failed)."""

    rank: int
    attempt: int
    step: int
    ranks: tuple[int, ...]
    error: str = ""


@dataclass(frozen=True)
class RecoveryTimeout:
    attempt: int
    gen: int


Event = (AgentJoined | WorkerExited | WorkerHung | AgentStopped | AgentLost | StandbyJoined | SessionReady | StepSynced
         | WorkerPaused | ReplacementJoined | WorkerResumed | RecoveryTimeout | WorkerDamaged | StepDumped
         | WorkerDegraded)


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


@dataclass(frozen=True)
class CommitStep:
    gen: int
    step: int


@dataclass(frozen=True)
class AbortGeneration:
    """Tell every live worker of the attempt to leave generation ``gen - 1`` (abort its collectives)."""

    gen: int
    reason: str


@dataclass(frozen=True)
class RestartRanks:
    ranks: frozenset[int]
    gen: int
    agent: int  # the agent that starts them: their own (in place) or a standby (recover)


@dataclass(frozen=True)
class Regroup:
    gen: int
    resume_step: int
    replaced: frozenset[int]
    direction: str = ""
    reason: str = ""


@dataclass(frozen=True)
class Recovered:
    gen: int
    resume_step: int
    replaced: frozenset[int]


@dataclass(frozen=True)
class DumpOrder:
    """Survivors write the state at ``step``; ``assign`` maps each lost rank to its writer."""

    gen: int
    step: int
    assign: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class CommitDump:
    step: int


Action = (StartAttempt | StopAttempt | KillWorker | Decide | Finish | CommitStep | AbortGeneration
          | RestartRanks | Regroup | Recovered | DumpOrder | CommitDump)


@dataclass(frozen=True)
class Recovery:
    """An in-flight recovery in progress: which ranks are replaced, who is ready."""

    rung: str
    gen: int
    replaced: frozenset[int]
    tries: int = 1
    paused: frozenset[int] = frozenset()
    positions: tuple[tuple[int, int, str], ...] = ()  # (rank, step, phase) of each paused survivor
    joined: frozenset[int] = frozenset()
    resumed: frozenset[int] = frozenset()
    regrouped: bool = False
    dump_step: int = -1
    dumped: frozenset[int] = frozenset()


@dataclass(frozen=True)
class JobState:
    world_size: int
    nnodes: int
    max_restarts: int
    allowed: tuple[str, ...] = (Rung.EXIT,)
    phase: JobPhase = JobPhase.STARTING
    attempt: int = 0
    restarts_used: int = 0
    agents: frozenset[int] = frozenset()
    stopped_agents: frozenset[int] = frozenset()
    finished_ranks: frozenset[int] = frozenset()
    hung_ranks: frozenset[int] = frozenset()
    first_failure: Failure | None = None
    failures: tuple[Failure, ...] = field(default_factory=tuple)
    gen: int = 0
    committed_step: int = -1
    sync_step: int = -1
    synced: frozenset[int] = frozenset()
    ready: frozenset[int] = frozenset()
    num_replicas: int = 0
    recovery: Recovery | None = None
    max_recovery_tries: int = 3
    placement: tuple[int, ...] = ()  # the agent hosting each rank; () means rank // (world / nnodes)
    replicas_allowed: bool = True  # False: --no-replica-restore
    can_dump: bool = False  # a storage tier exists (--save)
    sub_health_policy: str = "ignore"  # "grace-exit": a degraded rank -> dump, clean restart
    crash_loop_limit: int = 3  # the same failure this many times in a row fails the job (0: never)
    standbys: frozenset[int] = frozenset()

    @property
    def ranks(self) -> frozenset[int]:
        return frozenset(range(self.world_size))

    def agent_of(self, rank: int) -> int:
        return self.placement[rank] if self.placement else rank // (self.world_size // self.nnodes)

    def hosts(self) -> frozenset[int]:
        """The agents that host ranks now."""
        return frozenset(self.agent_of(r) for r in range(self.world_size))
