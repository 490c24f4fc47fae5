"""The events the controller's pure state machine (:mod:`unbroken.controller.machine`) reacts to.

All frozen dataclasses. Where an event is exactly a wire message (:class:`SessionReady`,
:class:`StepSynced`) the message *is* the event; where the controller adds what it knows (the
step a rank was at), the event is its own class under the message's name (:class:`RankExited`
and ``messages.RankExited``, :class:`RankPaused` and ``messages.RankPaused``). The job state and
the actions are in :mod:`unbroken.controller.api`.
"""

from __future__ import annotations

from dataclasses import dataclass

from unbroken.controller.values import RankSet
from unbroken.names import Phase
from unbroken.protocol.messages import SessionReady, StepSynced
from unbroken.recovery.restore_point import RankOffer

__all__ = ["SessionReady", "StepSynced"]  # the wire's nouns this module uses as its own


@dataclass(frozen=True)
class AgentJoined:
    node_rank: int


@dataclass(frozen=True)
class RankExited:
    """A rank's process exited (``step``: the steps it had completed, as last reported)."""

    rank: int
    attempt: int
    exit_code: int | None
    signal: int | None
    step: int | None = None
    last_lines: tuple[str, ...] = ()


@dataclass(frozen=True)
class LoopFinished:
    """A rank reported that it left its step loop (Progress phase ``finished``): its training is done."""

    rank: int
    attempt: int


@dataclass(frozen=True)
class RankHung:
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
    """An agent's connection is gone. ``last_steps``: the newest step each rank of the job had
    reported (None: none), indexed by rank; () where unknown."""

    node_rank: int
    last_steps: tuple[int | None, ...] = ()


@dataclass(frozen=True)
class StandbyJoined:
    """A spare agent (`unbroken run --standby`) that can host replaced ranks (rung `recover`)."""

    agent: int


@dataclass(frozen=True)
class RankPaused:
    """A survivor left the broken generation and waits for the regroup order."""

    rank: int
    attempt: int
    step: int
    phase: str = Phase.COMPUTE
    cut_in_tail: bool = False  # as messages.RankPaused.cut_in_tail
    cut: str | None = None  # cut inside the reduction of a vote-less step: "" exact, or why it is unsure; None: not


@dataclass(frozen=True)
class ReplacementJoined:
    rank: int
    attempt: int
    gen: int


@dataclass(frozen=True)
class RankResumed:
    rank: int
    attempt: int
    gen: int


@dataclass(frozen=True)
class RankDegraded:
    """A live rank reports sub-health (``--sub-health-policy`` says what follows)."""

    rank: int
    attempt: int
    reason: str
    step: int | None = None


@dataclass(frozen=True)
class RankDamaged:
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
class RanksSynced:
    """The StepSynced of several ranks at once (a node's relayed batch, agent/relay.py): one
    transition for what one StepSynced per rank, in a row, would do."""

    ranks: RankSet
    attempt: int
    gen: int
    step: int


@dataclass(frozen=True)
class TerminateRequested:
    """An agent got SIGTERM (pod eviction, `scancel`): dump the newest committed step, then stop."""

    reason: str  # e.g. "terminated (SIGTERM) on node 1"


@dataclass(frozen=True)
class GraceExpired:
    """The SIGTERM dump did not finish within ``--sigterm-dump-timeout-s``."""

    timeout_s: float


@dataclass(frozen=True)
class RecoveryTimeout:
    attempt: int
    gen: int


@dataclass(frozen=True)
class RegroupRefused:
    """The regroup order of ``gen`` cannot be carried out exactly (``why``): e.g. it rolls a step
    forward on a survivor's vote, and a replaced rank's own state after that step's compute never
    reached the controller (recovery/consistency.py)."""

    gen: int
    why: str


@dataclass(frozen=True)
class RestoreOffered:
    """At a (re)start, a rank offers the steps it can load in restore round ``round``."""

    rank: int
    attempt: int
    round: int
    offer: RankOffer


@dataclass(frozen=True)
class StepPersisted:
    """An agent wrote its ranks' storage files of ``step`` (``error``: it failed)."""

    step: int
    ranks: tuple[int, ...]
    seconds: float = 0.0
    error: str = ""


Event = (AgentJoined | RankExited | LoopFinished | RankHung | AgentStopped | AgentLost | StandbyJoined | SessionReady | StepSynced
         | RanksSynced | RankPaused | ReplacementJoined | RankResumed | RecoveryTimeout | RegroupRefused | RankDamaged
         | StepDumped | RankDegraded | RestoreOffered | StepPersisted | TerminateRequested | GraceExpired)
