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
#: Rung `elastic` (a node lost, no standby: the survivors go on at a smaller world): ``exact`` keeps the
#: global batch and the sample order (the survivors run the lost ranks' micro-batches too); ``fast`` trains
#: on the survivors' own batches only (a smaller global batch, the LR scaled by ``elastic_lr_scaling``).
ELASTIC_MODES = ("exact", "fast")
#: How `fast` mode scales the learning rate it hands the script (``job.lr_scale``): by the data-parallel
#: world's ratio new/original, its square root, or not at all.
ELASTIC_LR_SCALINGS = ("none", "linear", "sqrt")


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
    elastic_mode: str = "exact"  # --elastic-mode: rung elastic keeps the global batch (exact) or shrinks it (fast)
    min_nodes: int = 1  # --min-nodes: rung elastic never shrinks the job below this many nodes
    elastic_lr_scaling: str = "none"  # --elastic-lr-scaling: fast mode's LR rule (job.lr_scale)
    scale_out: bool = True  # False: --no-scale-out (a shrunk job never grows back when its nodes return)

    def __post_init__(self) -> None:
        require(self.max_restarts >= 0, f"--max-restarts must be >= 0, got {self.max_restarts}")
        for name in self.allowed:
            require_strategy(name)
        require(bool(self.allowed), "--recover-strategy must name at least one strategy")
        require(self.max_recovery_tries >= 1, f"max_recovery_tries must be >= 1, got {self.max_recovery_tries}")
        require(self.crash_loop_limit >= 0, f"--crash-loop-limit must be >= 0 (0: off), got {self.crash_loop_limit}")
        require(self.max_recurring >= 1, f"--max-recurring-recoveries must be >= 1, got {self.max_recurring}")
        require(self.elastic_mode in ELASTIC_MODES, f"--elastic-mode: unknown mode {self.elastic_mode!r} "
                f"(allowed: {', '.join(ELASTIC_MODES)})")
        require(self.elastic_lr_scaling in ELASTIC_LR_SCALINGS, f"--elastic-lr-scaling: unknown rule "
                f"{self.elastic_lr_scaling!r} (allowed: {', '.join(ELASTIC_LR_SCALINGS)})")
        require(self.min_nodes >= 1, f"--min-nodes must be >= 1, got {self.min_nodes}")
        require(self.elastic_mode == "fast" or self.elastic_lr_scaling == "none",
                f"--elastic-lr-scaling {self.elastic_lr_scaling} needs --elastic-mode fast (exact mode keeps "
                "the global batch, so the learning rate stays the script's)")
        require(self.sub_health_policy in SUB_HEALTH_POLICIES, f"--sub-health-policy: unknown policy "
                f"{self.sub_health_policy!r} (allowed: {', '.join(SUB_HEALTH_POLICIES)})")
