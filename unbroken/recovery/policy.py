"""What the user decided about recovery for one job: the ladder reads it (:mod:`unbroken.recovery.ladder`),
the controller's state machine carries it (:class:`unbroken.controller.api.JobState` holds it). Pure data."""

from __future__ import annotations

from dataclasses import dataclass

from unbroken.names import Rung


@dataclass(frozen=True)
class JobPolicy:
    """What the user decided for the job (flags of `unbroken run`): fixed for its whole life.
    The machine reads it and never changes it; :class:`~unbroken.controller.api.JobState` holds what changes."""

    world_size: int
    nnodes: int
    max_restarts: int
    allowed: tuple[str, ...] = (Rung.EXIT,)  # --recover-strategy, in ladder order
    max_recovery_tries: int = 3
    replicas_allowed: bool = True  # False: --no-replica-restore
    can_dump: bool = False  # a storage tier exists (--save)
    sub_health_policy: str = "ignore"  # "grace-exit": a degraded rank -> dump, clean restart
    crash_loop_limit: int = 3  # the same failure this many times in a row fails the job (0: never)
    max_recurring: int = 2  # in-flight recoveries of a fault that recurs before one held; then a job restart
