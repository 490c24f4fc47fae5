"""What the user decided about recovery: the ``recovery`` section of the launcher's config
(:attr:`unbroken.config.LaunchConfig.recovery`), which the controller's state machine carries
(:class:`unbroken.controller.api.JobState`) and the ladder reads (:mod:`unbroken.recovery.ladder`).
One class, no translation on the way: a field here is the config's key. Pure data, validated when built."""

from __future__ import annotations

from dataclasses import dataclass

from unbroken.limits import require, require_strategy
from unbroken.names import Rung

#: What a rank reported degraded (sub-health) leads to: nothing, or a dump and a clean restart.
SUB_HEALTH_POLICIES = ("ignore", "grace-exit")


@dataclass(frozen=True)
class JobPolicy:
    """The job's recovery policy (flags of `unbroken run`, named in each comment): fixed for its whole
    life. The state machine reads it and never changes it; :class:`~unbroken.controller.api.JobState`
    holds what changes."""

    max_restarts: int = 32767  # --max-restarts: job restarts (rung exit) before the job fails
    allowed: tuple[str, ...] = (Rung.RETRY, Rung.RECOVER_IN_PLACE, Rung.RECOVER, Rung.EXIT)  # --recover-strategy
    max_recovery_tries: int = 3  # in-flight tries of one fault before the ladder falls to a job restart
    replicas_allowed: bool = True  # False: --no-replica-restore (checkpoints only, the seeds' no-replica)
    sub_health_policy: str = "ignore"  # --sub-health-policy; "grace-exit": a degraded rank -> dump, clean restart
    crash_loop_limit: int = 3  # --crash-loop-limit: the same failure this many times in a row fails the job (0: never)
    max_recurring: int = 2  # --max-recurring-recoveries: in-flight recoveries of a fault that recurs before one held

    def __post_init__(self) -> None:
        require(self.max_restarts >= 0, f"--max-restarts must be >= 0, got {self.max_restarts}")
        for name in self.allowed:
            require_strategy(name)
        require(bool(self.allowed), "--recover-strategy must name at least one strategy")
        require(self.max_recovery_tries >= 1, f"max_recovery_tries must be >= 1, got {self.max_recovery_tries}")
        require(self.crash_loop_limit >= 0, f"--crash-loop-limit must be >= 0 (0: off), got {self.crash_loop_limit}")
        require(self.max_recurring >= 1, f"--max-recurring-recoveries must be >= 1, got {self.max_recurring}")
        require(self.sub_health_policy in SUB_HEALTH_POLICIES, f"--sub-health-policy: unknown policy "
                f"{self.sub_health_policy!r} (allowed: {', '.join(SUB_HEALTH_POLICIES)})")
