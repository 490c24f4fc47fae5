"""The controller's nouns: job phases, failures, the actions it orders, and the job state its
pure state machine (:mod:`unbroken.controller.machine`) carries from one event to the next
(the events are in :mod:`unbroken.controller.events`). All frozen dataclasses: no sockets,
no threads.

Each noun is declared once: where an event or an action is exactly a wire message
(:class:`SessionReady`, :class:`StepSynced`, :class:`CommitStep`) the message *is* the noun;
where the controller adds what it knows (the step a rank was at, a kill's pid), the noun is its
own class: under the message's name where the act is the same (:class:`RankExited` and
``messages.RankExited``, :class:`KillRank` and ``messages.KillRank``), under its own where the
act differs (:class:`OrderRegroup` vs ``messages.Regroup``). One act, one name: a rank's acts
say *rank* on the wire, in the machine and in the event log (``rank_exited``, ``kill_rank``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from unbroken.controller.values import Chain, RankSet
from unbroken.names import Rung
from unbroken.protocol.messages import CommitStep
from unbroken.recovery.policy import JobPolicy
from unbroken.recovery.restore_point import RankOffer, RestorePoint

__all__ = ["CommitStep", "JobPolicy"]  # the nouns of the wire and of recovery this module uses as its own


class JobPhase(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    RECOVERING = "recovering"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TERMINATED = "terminated"  # stopped on SIGTERM (after its dump, where one could be made)


#: The phases after which no event changes the job any more.
FINAL_PHASES = frozenset({JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.TERMINATED})


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
    gen: int = 0  # the generation it happened in: failures of one (attempt, gen) are one episode


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
               "recovery-refused": "could not be recovered exactly in flight (the decision before this one says why)",
               "sub-health": "was reported degraded (sub-health)",
               "sub-health-dumped": "was reported degraded; the job's state was dumped for a clean restart",
               }.get(self.kind, "exited")
        detail = f" (signal {self.signal})" if self.signal else (
            f" (exit code {self.exit_code})" if self.exit_code is not None else "")
        # step None: the rank reported no completed step (it has not finished one, or it does
        # not report steps: a script without job.steps()); never claim which.
        step = "with no step reported" if self.step is None else f"at step {self.step}"
        return f"rank {self.rank} {how}{detail} {step}, attempt {self.attempt}"


# -- actions -----------------------------------------------------------------------------
@dataclass(frozen=True)
class StartAttempt:
    attempt: int


@dataclass(frozen=True)
class StopAttempt:
    attempt: int
    reason: str


@dataclass(frozen=True)
class KillRank:
    """Kill the current process of ``rank`` (its agent is told the pid)."""

    rank: int
    reason: str


@dataclass(frozen=True)
class ExitedAfterLoop:
    """A rank that had finished its step loop exited abnormally (a signal, a crash at interpreter
    exit): a warning for the event log; the rank counts as finished, nothing is recovered."""

    rank: int
    exit_code: int | None
    signal: int | None
    step: int | None
    hung: bool = False  # it hung after its loop and the controller killed it (loop_end.on_hung_after_loop)


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
class OrderRegroup:
    """Every rank joins generation ``gen`` and resumes at ``resume_step``; ``replaced`` get state."""

    gen: int
    resume_step: int
    replaced: frozenset[int]
    direction: str = ""
    reason: str = ""
    # The decision rests on a commit vote the controller's record had not seen (a survivor passed it);
    # said in the event log. (Either way a replaced rank needs its own state, or a copy known to equal it.)
    voted: bool = False
    # Survivors cut inside the reduction of step resume_step - 1, which a peer updated (worker/commit.py):
    # they take the replicated state as ``replaced`` ranks do, and keep their own state from the cut.
    behind: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Recovered:
    gen: int
    resume_step: int
    replaced: frozenset[int]


@dataclass(frozen=True)
class RecoveryHeld:
    """The in-flight recovery of generation ``gen`` held: every rank completed ``resume_step``."""

    gen: int
    resume_step: int


@dataclass(frozen=True)
class DumpOrder:
    """Survivors write the state at ``step``; ``assign`` maps each lost rank to its writer."""

    gen: int
    step: int
    assign: tuple[tuple[int, int], ...]
    voted: bool = False  # as OrderRegroup.voted


@dataclass(frozen=True)
class CommitDump:
    step: int


@dataclass(frozen=True)
class Terminating:
    """The job was asked to stop (SIGTERM): whether it dumps first, and why (for the event log)."""

    dump: bool
    reason: str


@dataclass(frozen=True)
class AnswerRestore:
    """Tell ``rank`` again the step decided for its restore round (it offered twice)."""

    rank: int
    attempt: int
    round: int
    step: int


@dataclass(frozen=True)
class RestoreDecided:
    """Every rank offered for ``round``: log the decision and tell every rank ``point.step``."""

    attempt: int
    round: int
    point: RestorePoint
    below: int | None


@dataclass(frozen=True)
class ScaleOut:
    """Rung elastic grows the job back (controller/elastic.py): for the event log and the clock."""

    from_world: int
    to_world: int
    agents: tuple[int, ...]  # the agents taken in
    step: int  # the committed step it was decided at
    reason: str


@dataclass(frozen=True)
class ScaleOutRefused:
    """A scale-out that cannot be made (or was undone): the job trains on at its smaller size."""

    world_size: int
    agents: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class CommitPersisted:
    """Every rank's files of ``step`` are in storage: write its manifest (the commit)."""

    step: int
    seconds: float


Action = (StartAttempt | StopAttempt | KillRank | ExitedAfterLoop | Decide | Finish | CommitStep | AbortGeneration
          | RestartRanks | OrderRegroup | Recovered | DumpOrder | CommitDump | AnswerRestore | RestoreDecided
          | CommitPersisted | Terminating | RecoveryHeld | ScaleOut | ScaleOutRefused)


@dataclass(frozen=True)
class RestoreRounds:
    """The restore at a (re)start of ``attempt``: offers of open rounds, and decided steps."""

    attempt: int = -1
    offers: tuple[tuple[int, int, RankOffer], ...] = ()  # (round, rank, offer)
    decided: tuple[tuple[int, int], ...] = ()  # (round, step)


@dataclass(frozen=True)
class Recovery:
    """An in-flight recovery in progress: which ranks are replaced, who is ready."""

    rung: str
    gen: int
    replaced: frozenset[int]
    tries: int = 1
    paused: RankSet = RankSet()
    # (rank, step, phase, cut) of each pause, newest first (cut: as events.RankPaused.cut)
    positions: Chain[tuple[int, int, str, str | None]] = Chain()
    joined: RankSet = RankSet()
    resumed: RankSet = RankSet()
    regrouped: bool = False
    dump_step: int = -1
    dumped: RankSet = RankSet()


@dataclass(frozen=True)
class Unconfirmed:
    """An in-flight recovery that finished (every rank resumed) but has not held yet: it holds once
    every rank completed ``resume_step`` (the next step committed). A rank that fails before that is
    the same fault recurring: the next recovery counts as try ``tries + 1``."""

    gen: int
    resume_step: int
    tries: int


@dataclass(frozen=True)
class Shape:
    """The shrunk shape a scale-out left (controller/elastic.py), kept until the first attempt at the
    launch's size restored: if the ranks taken in got no state, the job goes back to it."""

    world_size: int
    placement: tuple[int, ...]
    data_ranks: tuple[tuple[int, ...], ...]
    data_world_size: int
    lr_scale: float
    joining: frozenset[int]  # the agents the scale-out took in


@dataclass(frozen=True)
class JobState:
    """What the controller knows of the job now; every transition returns a new one."""

    policy: JobPolicy
    world_size: int  # ranks now: the launch's, fewer after rung elastic shrank the job (controller/elastic.py)
    nnodes: int = 1
    can_dump: bool = False  # a storage tier exists to dump to (--save)
    phase: JobPhase = JobPhase.STARTING
    attempt: int = 0
    restarts_used: int = 0
    agents: frozenset[int] = frozenset()
    stopped_agents: frozenset[int] = frozenset()
    finished_ranks: RankSet = RankSet()  # exited after their loop (cleanly, or as loop_finished)
    loop_finished: RankSet = RankSet()  # reported leaving their step loop, this attempt
    exited_after_loop: RankSet = RankSet()  # of those, exited abnormally afterwards (a warning)
    hung_after_loop: RankSet = RankSet()  # of those, killed for a hang after their loop (loop_end.py)
    hung_ranks: frozenset[int] = frozenset()
    first_failure: Failure | None = None
    failures: tuple[Failure, ...] = field(default_factory=tuple)
    gen: int = 0
    committed_step: int = -1
    sync_step: int = -1
    synced: RankSet = RankSet()
    ready: RankSet = RankSet()
    not_in_flight: tuple[tuple[int, str], ...] = ()  # (rank, why its state cannot be recovered in flight)
    num_replicas: int = 0
    mesh: tuple[tuple[str, int], ...] = ()  # the job's mesh (job.mesh), () for a flat data-parallel job
    mesh_replicate: str = ""  # the mesh dimension its replicas live along
    recovery: Recovery | None = None
    unconfirmed: Unconfirmed | None = None  # the last in-flight recovery, until it held
    placement: tuple[int, ...] = ()  # the agent hosting each rank; () means rank // (world / nnodes)
    standbys: frozenset[int] = frozenset()
    persisted: tuple[tuple[int, frozenset[int]], ...] = ()  # (step, ranks whose files are in storage)
    restore: RestoreRounds = field(default_factory=RestoreRounds)
    terminating: str = ""  # why the job is stopping on SIGTERM ("": it is not); see controller/terminate.py
    # Rung elastic (controller/elastic.py): the job's shape after it shrank; () and 0: the launch's shape.
    data_world_size: int = 0  # the data-parallel ranks the global batch is split into (0: world_size)
    data_ranks: tuple[tuple[int, ...], ...] = ()  # per rank, the data-parallel ranks it runs (): (rank,)
    restore_ranks: tuple[int, ...] = ()  # per rank, whose memory-tier snapshot it restores, first attempt after
    #                                      a shrink (): its own
    lr_scale: float = 1.0  # --elastic-lr-scaling's factor for the script (fast mode)
    not_exact: tuple[tuple[int, str], ...] = ()  # (rank, why its script cannot keep the global batch smaller)
    # Scale-out (controller/elastic.py): back to the launch's shape once the lost nodes (or standbys) are there.
    launch_placement: tuple[int, ...] = ()  # the agent of each rank of the launch's world, kept at the first
    #                                         shrink (): never shrunk
    fetch_from: tuple[tuple[int, int], ...] = ()  # per rank, first attempt after a scale-out: (agent, rank) whose
    #                                               snapshot its agent fetches first ((-1, -1): none)
    growing: Shape | None = None  # the shape before the scale-out in progress (until it restored)
    no_grow: frozenset[int] = frozenset()  # agents a scale-out failed to take in (again once they rejoin)
    snapshot_every: int = 0  # memory-tier snapshots every this many steps, fetchable by a peer agent (0: none)

    @property
    def ranks(self) -> RankSet:
        return RankSet.full(self.world_size)

    def agent_of(self, rank: int) -> int:
        """The agent hosting ``rank``; -1 for a rank the job no longer has (rung elastic shrank it: a late
        message or a stale view of a process of the larger world)."""
        if rank >= self.world_size:
            return -1
        return self.placement[rank] if self.placement else rank // (self.world_size // self.nnodes)

    def hosts(self) -> frozenset[int]:
        """The agents that host ranks now."""
        if self.placement:
            return frozenset(self.placement)
        per_agent = self.world_size // self.nnodes  # agent_of without a placement
        return frozenset(range((self.world_size - 1) // per_agent + 1)) if self.world_size else frozenset()
