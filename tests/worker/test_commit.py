"""The step's commit without a vote (worker/commit.py), its pieces in one process: when a step may
go without one, what rules it out, and a rank's own state at a cut inside the reduction."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.parallel.test_group import _pair
from unbroken.faults.inject import FaultInjector
from unbroken.parallel.group import AbortSignal
from unbroken.worker.api import RecoverableState, SessionHooks
from unbroken.worker.commit import VOTE_EVERY, CommitVotes
from unbroken.worker.rollback import StepStates
from unbroken.worker.tracked import TrackedState

pytestmark = pytest.mark.timeout(30)
HOOKS = SessionHooks(lambda *a: None, lambda: False, False)


def _tracked(**objects) -> TrackedState:
    tracked = TrackedState()
    for name, obj in objects.items():
        tracked.add(name, obj, HOOKS)
    tracked.frozen = True
    return tracked


class _Ops:
    """What CommitVotes reads of a fabric: the first op seen that may leave ranks different state."""

    partial_op: str | None = None


class _Shard(RecoverableState):
    """A recoverable object (as the sharded optimizer): each rank holds its own part."""

    def num_replicas(self): return 1
    def attach(self, hooks): pass
    def step_pending(self): return False
    def abandoned_work(self): return []
    def set_process_group(self, process_group): pass
    def recover(self, replaced): pass
    def release_process_groups(self): pass
    def state_dict(self): return {}
    def load_state_dict(self, state): pass


def _votes(tracked: TrackedState, fabric=_Ops, mesh: bool = False) -> CommitVotes:
    return CommitVotes(0, device=torch.device("cpu"), injector=FaultInjector([], 0, lambda fault: True),
                       tracked=tracked, fabric=fabric() if fabric is not None else None, mesh=lambda: mesh)


def _vote(votes: CommitVotes, step: int, gen: int) -> bool:
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=10))
    joined = []
    assert votes.vote(step, gen, group, lambda: joined.append(step), None, [])
    return joined == [step]


def test_a_generation_goes_without_votes_once_its_first_vote_saw_nothing_against():
    model = torch.nn.Linear(4, 4)
    votes = _votes(_tracked(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)))
    assert votes.why_voting() is None
    assert votes.needed(3, 0), "a generation's first step votes"
    assert _vote(votes, 3, 0)
    assert not votes.needed(4, 0) and not votes.needed(VOTE_EVERY + 1, 0)
    assert votes.needed(VOTE_EVERY, 0) and votes.needed(2 * VOTE_EVERY, 0), "a vote every VOTE_EVERY steps"
    assert votes.needed(4, 1), "a new generation votes first"


@pytest.mark.parametrize("why", ["no-fabric", "mesh", "partial-op", "recoverable"])
def test_what_rules_the_vote_less_commit_out_keeps_every_step_voting(why):
    model = torch.nn.Linear(4, 4)
    objects = {"model": model}
    fabric, mesh = _Ops, why == "mesh"
    if why == "no-fabric":
        fabric = None
    elif why == "partial-op":
        fabric = type("Seen", (_Ops,), {"partial_op": "send on group 'g0'"})
    elif why == "recoverable":
        objects["optimizer"] = _Shard()
    votes = _votes(_tracked(**objects), fabric, mesh)
    assert votes.why_voting() is not None
    assert _vote(votes, 3, 0)
    assert votes.needed(4, 0)


def test_a_surviving_group_tells_each_op_it_issues():
    store, graveyard = dist.HashStore(), []
    groups = _pair(store, 0, [AbortSignal(), AbortSignal()], graveyard)
    seen: list[tuple[str, str]] = []
    for g in groups:
        g.on_op = lambda group, op: seen.append((group.key, op))
    opts = dist.AllreduceOptions()
    works = [g.allreduce([torch.ones(2)], opts) for g in groups]
    for w in works:
        w.wait()
    send, recv = groups[0].send([torch.ones(2)], 1, 0), groups[1].recv([torch.zeros(2)], 0, 0)
    send.wait(), recv.wait()
    assert seen == [("g0", "allreduce"), ("g0", "allreduce"), ("g0", "send"), ("g0", "recv")]


def test_a_rank_cut_inside_the_reduction_keeps_its_state_only_where_it_is_its_state_after_compute():
    tracked = _tracked(model=torch.nn.Linear(2, 2))
    states = StepStates(0)
    states.begin(0, *tracked.step_start())
    states.at_sync(tracked.per_rank_tree())
    state, why = states.at_cut(tracked.per_rank_tree())
    assert state is not None and why == ""
    torch.rand(())  # a draw inside the reduction
    state, why = states.at_cut(tracked.per_rank_tree())
    assert state is None and "moved inside the reduction" in why
    # a step whose state moved between its reduction and its update: no later cut is trusted (sticky)
    states.after_compute(tracked.per_rank_tree())
    states.begin(1, *tracked.step_start())
    states.at_sync(tracked.per_rank_tree())
    state, why = states.at_cut(tracked.per_rank_tree())
    assert state is None and "moved between the start of step 0's reduction and its update" in why
    states.begin(2, *tracked.step_start())
    assert not states.in_sync and states.at_cut(tracked.per_rank_tree())[0] is None
