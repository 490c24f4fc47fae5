"""The consistency rule (DESIGN.md section 4): after a fault, which step does the job resume at?

Pure functions, no processes. The invariant they serve: training continues from a state
that the fault-free run also had, so the final weights equal it bit for bit.

How a step commits. Every rank reports entering ``update`` for step k only after its
gradient reduction of step k completed, and then waits for the controller's commit of
step k. The controller commits k when *every* rank has reported it, and it decides that
under the same lock as it learns of faults, so "k committed" is atomic: either every
survivor will apply update k (roll forward), or none has started it (roll back). No shard
is ever left half-updated, whatever subset of ranks had finished the reduction, including
the case where the dead rank was the only one that had.

Hence the rule: the job resumes at the first uncommitted step. A survivor in step
``committed + 1`` rolls back to its start (drops gradients, restores its step-start RNG);
a survivor still finishing step ``committed`` (its parameter gather was cut) completes it
from replicas during the regroup.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Mapping

from unbroken.names import STEP_PHASES, Phase



class Direction(enum.Enum):
    ROLL_BACK = "roll-back"        # the step in flight is redone from its start
    ROLL_FORWARD = "roll-forward"  # the step in flight was committed: it completes, the next is redone


@dataclass(frozen=True)
class Position:
    """Where a survivor reported itself: the step in flight (== steps completed) and its phase."""

    step: int
    phase: str

    def __post_init__(self) -> None:
        if self.phase not in STEP_PHASES:
            raise ValueError(f"unknown phase {self.phase!r} (allowed: {', '.join(STEP_PHASES)})")


@dataclass(frozen=True)
class Decision:
    direction: Direction
    step_in_flight: int
    resume_step: int
    reason: str


class InconsistentReports(ValueError):
    """The survivors' reports contradict the commit record: a bug, never a normal fault."""


def decide(committed_step: int, survivors: Mapping[int, Position]) -> Decision:
    """The step everyone resumes at, from the commit record and the survivors' positions.

    ``committed_step`` is the newest step the controller committed (-1: none yet).
    A survivor's ``Position.step`` is its step in flight; a survivor that finished step
    k and has not begun k+1 reports (k + 1, "compute").
    """
    if not survivors:
        raise ValueError("no survivors: in-flight recovery needs at least one")
    resume = committed_step + 1
    for rank, pos in sorted(survivors.items()):
        # A survivor can be at most the step after the newest commit (k+1 needs commit k to
        # start), and not before the committed step itself (commit k needs every rank in k).
        if not committed_step <= pos.step <= resume:
            raise InconsistentReports(
                f"rank {rank} reports step {pos.step} but the newest committed step is {committed_step}")
        if pos.step == resume and pos.phase in (Phase.UPDATE, Phase.DONE):
            raise InconsistentReports(
                f"rank {rank} reports phase {pos.phase!r} of uncommitted step {pos.step}")
        if pos.step == committed_step and pos.phase in (Phase.COMPUTE, Phase.SYNC):
            raise InconsistentReports(
                f"rank {rank} reports phase {pos.phase!r} of step {pos.step}, which committed only after "
                "every rank finished its reduction")
    in_flight = max(pos.step for pos in survivors.values())
    if in_flight == committed_step:
        return Decision(Direction.ROLL_FORWARD, in_flight, resume,
                        f"step {in_flight} was committed (every rank finished its gradient reduction): "
                        f"survivors complete it, the job resumes at step {resume}")
    phases = sorted({pos.phase for pos in survivors.values() if pos.step == in_flight})
    return Decision(Direction.ROLL_BACK, in_flight, resume,
                    f"step {in_flight} was not committed (survivors in {', '.join(phases)}): "
                    f"every rank redoes it from its start")
