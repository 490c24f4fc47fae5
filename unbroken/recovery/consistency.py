"""The consistency rule (DESIGN.md section 4): after a fault, which step does the job resume at?

Pure functions, no processes. The invariant they serve: training continues from a state
that the fault-free run also had, so the final weights equal it bit for bit.

How a step commits. Every rank, once its gradient reduction of step k completed, joins the
*commit vote* of step k, a 1-element all-reduce on the generation's group
(:meth:`unbroken.worker.inflight.InFlight.commit_vote`), and reports to the controller that
it did (StepSynced, with its own state after compute; not waited for: the report after the
joining, so the hang rule sees who waits in the vote and who never reached it). The vote completes on a rank only
after every rank joined it, i.e. finished its reduction, so "a step's update begins only once
every rank's reduction is done" holds without a controller round trip. The controller
records k committed when it has every rank's StepSynced of k, and learns it at a recovery
from the survivors' positions (:func:`voted_step`): a survivor in update k, or past it,
passed the vote of k.

A rank dying inside the vote can leave it completed on some survivors and not on others (a
split vote). Those still waiting do not drop the step: they report themselves paused in the
vote, position (k, ``sync``), their gradients whole, and wait for the decision. The decision
is ``committed = max(record, newest step a survivor passed)``: if k committed, the survivors
paused in its vote apply update k from their own gradients (roll forward), the others
complete it; if not, nobody alive began update k and every rank redoes it from its start
(roll back). A replaced rank rolled forward gets its own state after the compute of k, which
it sent as it joined the vote; where the controller has none (it died between joining and
reporting, or its node was lost with the report), the recovery refuses in flight rather than
hand it another rank's copy. No shard is
ever left half-updated.

Most steps need no vote (worker/commit.py): where every rank holds the whole state and the job's
collectives replicate, a rank updates once its own reduction completed, and the step commits as
soon as any rank updates. A survivor cut inside that reduction reports (k, ``sync``) *cut*: when a
peer passed k (``voted_step`` reads the same positions) it is *behind*: it takes the updated state
from a peer in the regroup and keeps its own state from the cut (controller/machine.py refuses where
that state is not known to be its state after compute). A lost rank's state after compute comes
from its commit report or, where that never left, from the file its agent read
(checkpoint/own_state.py).

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

    ``committed_step`` is the newest step the controller recorded committed (-1: none yet); the
    survivors may show a newer one (:func:`voted_step`). A survivor's ``Position.step`` is its
    step in flight; a survivor that finished step k and has not begun k+1 reports (k + 1,
    "compute"); one paused in the commit vote of k reports (k, "sync").
    """
    if not survivors:
        raise ValueError("no survivors: in-flight recovery needs at least one")
    committed = voted_step(committed_step, survivors)
    resume = committed + 1
    for rank, pos in sorted(survivors.items()):
        # A survivor can be at most the step after the newest commit (k+1 needs the vote of k), and
        # not before the committed step itself (the vote of k needs every rank's reduction of k).
        if not committed <= pos.step <= resume:
            raise InconsistentReports(
                f"rank {rank} reports step {pos.step} but the newest committed step is {committed}")
        if pos.step == committed and pos.phase == Phase.COMPUTE:
            raise InconsistentReports(
                f"rank {rank} reports phase {pos.phase!r} of step {pos.step}, which committed only after "
                "every rank finished its reduction")
    in_flight = max(pos.step for pos in survivors.values())
    if in_flight == committed:
        return Decision(Direction.ROLL_FORWARD, in_flight, resume,
                        f"step {in_flight} was committed (every rank finished its gradient reduction): "
                        f"survivors complete it, the job resumes at step {resume}")
    phases = sorted({pos.phase for pos in survivors.values() if pos.step == in_flight})
    return Decision(Direction.ROLL_BACK, in_flight, resume,
                    f"step {in_flight} was not committed (survivors in {', '.join(phases)}): "
                    f"every rank redoes it from its start")


def voted_step(committed_step: int, survivors: Mapping[int, Position]) -> int:
    """The newest step known committed: the controller's record, or the newest step a survivor
    began updating or left (it passed that step's commit vote, which needs every rank's reduction)."""
    passed = (pos.step if pos.phase in (Phase.UPDATE, Phase.DONE) else pos.step - 1 for pos in survivors.values())
    return max(committed_step, *passed)
