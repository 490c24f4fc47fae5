"""How one rank commits a step: by a vote among the ranks, or, where every rank holds the whole
state, without one (recovery/consistency.py has the rule both serve).

**The vote.** After its reduction a rank joins a small all-reduce on the generation's group (MAX of
``step``, ``-step`` and a flag, below) and updates only once it completed: every rank then finished
its reduction, so no rank updates from gradients another lacks. It costs a round of the ring per
step (3 ms of a 15 ms step at 4 ranks on 2 cores, docs/scale.md).

**The vote-less commit.** Where no tracked object is held in part (no sharded optimizer, no
DTensors, no ``job.mesh``) and the job's collectives leave every rank the same result (all-reduces,
broadcasts and all-gathers on the world group: DDP, ``job.all_reduce``), the update a rank makes
from its completed reduction is the update every rank makes. Then a rank updates as soon as its own
reduction completed. A peer lost inside the reduction may leave it completed on some survivors and
not on others; those without it (cut inside it, their gradients not whole) take the post-update
state from a survivor that made the update, as a replacement does, and keep their own per-rank
state from the cut when it is known to be their state after compute (worker/step_boundary.py). What
the vote checks besides is checked by a vote at each generation's first step and every
:data:`VOTE_EVERY` steps, whose flag says whether any rank saw what rules the vote-less commit out
(:meth:`CommitVotes.why_voting`): a generation whose vote saw it votes on every step.

Lives in the training thread of one rank, owned by its :class:`~unbroken.worker.inflight.InFlight`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from unbroken.comm.wait import AbortCheck, wait_all
from unbroken.errors import CollectiveAborted, FatalError
from unbroken.faults.inject import FaultInjector
from unbroken.names import Phase
from unbroken.parallel.fabric import Fabric
from unbroken.worker.tracked import TrackedState

#: A vote-less generation still votes on every step that is a multiple of this (its ranks in step,
#: the flag again): 1/64 of a vote per step.
VOTE_EVERY = 64


@dataclass(frozen=True)
class ReductionCut:
    """A rank cut inside the reduction of a vote-less step: its own (per-rank) state at the cut, encoded,
    when that is known to be its state after the step's compute; else None and why not."""

    state: bytes | None
    why_unsure: str = ""


class CommitVotes:
    """One rank's commit votes, and whether a step may go without one (see the module docstring)."""

    def __init__(self, rank: int, *, device: torch.device, injector: FaultInjector, tracked: TrackedState,
                 fabric: Fabric | None, mesh: Callable[[], bool]) -> None:
        self._rank, self._device, self._injector = rank, device, injector
        self._tracked, self._fabric, self._mesh = tracked, fabric, mesh
        self._voteless_gen = -1  # the generation whose last vote said its steps need none

    def needed(self, step: int, gen: int) -> bool:
        """Whether step ``step`` of generation ``gen`` votes (the same answer on every rank)."""
        return self._voteless_gen != gen or step % VOTE_EVERY == 0

    def why_voting(self) -> str | None:
        """What rules this rank's vote-less commit out, or None: a tracked object held in part, a mesh,
        an op seen that may leave ranks different state, no surviving groups (CUDA)."""
        if self._fabric is None:
            return "the process groups are not unbroken's surviving groups"
        if self._mesh():
            return "the job has a mesh (job.mesh): ranks hold different parts"
        partial = self._tracked.partial_object()
        if partial is not None:
            return f"the tracked object {partial} is held in part by each rank"
        if self._fabric.partial_op is not None:
            return f"the job issued a {self._fabric.partial_op}, after which ranks may hold different state"
        return None

    def vote(self, step: int, gen: int, group: Any, joined: Callable[[], None], should_abort: AbortCheck,
             graveyard: list[Any]) -> bool:
        """Step ``step``'s commit vote: an all-reduce (MAX of ``step``, ``-step`` and whether this rank
        rules the vote-less commit out) on ``group`` that completes once every rank finished its
        reduction; ``joined()`` runs once this rank joined it (it reports the reduction done: the
        controller then sees it waiting in the vote, controller/hangs.py). True: passed here, the
        update may begin. False: an abort order or a peer's loss came first (it may have passed
        elsewhere: InFlight.pause_in_vote). Ranks voting on different steps are a desynchronised job:
        fatal."""
        votes = torch.tensor([step, -step, int(self.why_voting() is not None)], dtype=torch.int64,
                             device=self._device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self._injector.at(step, Phase.VOTE)  # a fault planned for the vote: its reduction done, not joined yet
        work = group.allreduce([votes], opts)
        joined()
        try:
            wait_all([work], should_abort, graveyard, f"commit vote of step {step}")
        except (CollectiveAborted, RuntimeError):  # the abort order, or the backend's error on a lost peer
            return False
        newest, minus_oldest, voting = votes.tolist()
        oldest = -minus_oldest
        if newest != step or oldest != step:
            raise FatalError(f"rank {self._rank}: the commit vote of step {step} saw steps {oldest}..{newest}: "
                             "the ranks' training loops are not in step (a rank ran more or fewer steps)")
        self._voteless_gen = -1 if voting else gen
        return True
