"""How long a recovery took, from the fault to the job back at the step it hit.

Owned by the :class:`~unbroken.controller.server.Controller`, changed under its lock. The
first fault of a cascade starts the clock (:meth:`RecoveryTiming.fault_began`); the in-flight
milestones (decide, replacement joined, regroup, restore) are noted as they happen and
reported in ``recovered_in_flight``; after a job restart, ``recovered`` is reported once every
rank is back at the fault's step, with the step and tier the ranks restored from. A scale-out
(controller/elastic.py) is timed the same way, from its decision to every rank of the grown world
back at the step it was decided at, and reported as ``scaled_out``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from unbroken.controller.views import RankView


class RecoveryTiming:
    """The clock of the recovery in progress (see the module docstring)."""

    def __init__(self) -> None:
        self.fault_t: float | None = None  # when the failure being recovered was detected
        self.fault_step = 0
        self._resume_step: int | None = None  # where an in-flight recovery resumed
        self._milestones: dict[str, float] = {}  # in-flight recovery milestones (monotonic)
        self._restore_s: list[float] = []
        self._restored: dict[int, tuple[int, str]] = {}  # attempt -> (step, tier) of its first restore
        self._scale_out: dict[str, int] = {}  # a scale-out being timed: its from_world and to_world

    def fault_began(self, t: float, workers: Iterable[RankView]) -> None:
        """Note when (monotonic ``t``) and at which step the failure being recovered began,
        unless one is already being timed (the first fault of a cascade counts)."""
        if self.fault_t is None:
            self.fault_t, self.fault_step = t, max((v.step or 0) for v in workers)
        self._scale_out = {}  # a fault during a scale-out: what ends is a recovery

    def scale_out_began(self, t: float, workers: Iterable[RankView], from_world: int, to_world: int) -> None:
        """A scale-out was decided at ``t``: timed like a recovery, reported as ``scaled_out``."""
        if self.fault_t is None:
            self.fault_t, self.fault_step = t, max((v.step or 0) for v in workers)
            self._scale_out = {"from_world": from_world, "to_world": to_world}

    def scale_out_dropped(self) -> None:
        """The scale-out being timed was undone (or never began): nothing to report for it."""
        if self._scale_out:
            self.fault_t, self._scale_out = None, {}

    def decided(self, t: float) -> None:
        self._milestones = {"decide": t}

    @property
    def decided_t(self) -> float | None:
        """When the in-flight recovery in progress was ordered (its abort sent), if one was."""
        return self._milestones.get("decide")

    def mark(self, milestone: str, t: float, *, first: bool = False) -> None:
        """Note ``milestone`` ("joined", "regroup") at ``t`` (``first``: keep an earlier one)."""
        if first:
            self._milestones.setdefault(milestone, t)
        else:
            self._milestones[milestone] = t

    def resumed(self, restore_s: float) -> None:
        self._restore_s.append(restore_s)

    def restored(self, attempt: int, step: int, tier: str) -> None:
        """A rank of ``attempt`` restored ``step`` from ``tier`` (the first report counts)."""
        self._restored.setdefault(attempt, (step, tier))

    def recovered_in_flight(self, resume_step: int, now: float) -> dict[str, Any]:
        """The timings of the in-flight recovery that just ended (fields of ``recovered_in_flight``)."""
        t = self._milestones
        self._resume_step = resume_step
        decide = t.get("decide", now)
        fields = dict(
            detect_s=round(decide - self.fault_t, 4) if self.fault_t else None,
            replace_s=round(t.get("joined", decide) - decide, 4),
            regroup_s=round(t.get("regroup", now) - max(decide, t.get("joined", decide)), 4),
            restore_s=round(max(self._restore_s, default=0.0), 4),
            total_s=round(now - (self.fault_t or decide), 4),
            steps_redone=max(0, self.fault_step - resume_step))
        self._restore_s = []
        return fields

    @property
    def pending(self) -> bool:
        """A fault is being timed: its recovery has not been logged yet."""
        return self.fault_t is not None

    def check_recovered(self, workers: Iterable[RankView], attempt: int, now: float
                        ) -> tuple[str, dict[str, Any]] | None:
        """Once every rank is back at the step the fault hit: the event's name (``recovered``, or
        ``scaled_out``) and its fields (once)."""
        if self.fault_t is None or not all((w.step or 0) >= self.fault_step for w in workers):
            return None
        if self._resume_step is not None:  # in flight: state came from live replicas
            restored_step, tier = self._resume_step, "replicas"
        else:
            restored_step, tier = self._restored.get(attempt, (0, "none"))
        fields = dict(attempt=attempt, step=self.fault_step, recover_s=round(now - self.fault_t, 4),
                      restored_step=restored_step, tier=tier, **self._scale_out)
        name = "scaled_out" if self._scale_out else "recovered"
        self.fault_t, self._resume_step, self._scale_out = None, None, {}
        return name, fields
