"""Rung `elastic`: a node is lost and no standby can host its ranks, so the job goes on on the nodes
left. Pure, like :mod:`unbroken.controller.machine`, which calls :func:`shrink` for the ladder's
decision (:func:`unbroken.recovery.ladder.elastic_refusal` says when it is feasible).

The shrink is a job restart at a smaller world: the surviving nodes stop their workers, and the next
attempt starts their ranks renumbered ``0 .. n-1`` in the old rank order (whole nodes go, so every
surviving agent keeps its count of ranks). Each new rank restores the memory-tier snapshot its process
wrote under its old number on its own node (``restore_ranks``): the state of a lost rank is replicated
on every survivor (full replication; the ladder refuses sharded layouts), so nothing lost is needed.

*Virtual data ranks* keep what the global batch is made of. Each rank runs a list of data-parallel
ranks (``data_ranks``) of a data-parallel world of ``data_world_size``:

- ``exact``: the original world's; a survivor keeps its own and takes some of the lost ranks', so the
  global batch and the sample order are those of the fault-free run (the script accumulates the extra
  micro-batches; :meth:`unbroken.worker.session.Job.data_ranks`);
- ``fast``: the smaller world's, one each (a plain smaller job), and ``lr_scale`` for the script's
  learning rate (``--elastic-lr-scaling``).
"""

from __future__ import annotations

import math

from unbroken.controller.api import Decide, Failure, JobPhase, JobState, StopAttempt
from unbroken.controller.values import replace
from unbroken.recovery.ladder import Decision, FaultFacts


def shrink(state: JobState, failure: Failure, decision: Decision, facts: FaultFacts) -> tuple[JobState, list]:
    """Stop the surviving nodes' workers; the next attempt (machine's ``_on_agent_stopped``) starts the
    smaller world this returns the shape of."""
    lost = set(facts.lost_agents)
    keep = [r for r in range(state.world_size) if state.agent_of(r) not in lost]
    state = replace(state, **new_shape(state, keep), phase=JobPhase.STOPPING, stopped_agents=frozenset(),
                    recovery=None)
    return state, [Decide(decision.rung, failure, decision.reason),
                   StopAttempt(state.attempt, f"{decision.rung}: {failure.describe()}")]


def new_shape(state: JobState, keep: list[int]) -> dict:
    """The fields of the job's shape once only the ranks ``keep`` (old numbers, ascending) remain."""
    current = data_ranks_of(state)
    old_data_world = state.data_world_size or state.world_size
    if state.policy.elastic_mode == "exact":
        data = [list(current[r]) for r in keep]
        orphans = sorted(d for r in range(state.world_size) if r not in keep for d in current[r])
        for d in orphans:  # to the rank running the fewest, the lowest first: an even, deterministic split
            min(data, key=len).append(d)
        data_ranks, data_world, lr_scale = tuple(tuple(sorted(d)) for d in data), old_data_world, 1.0
    else:
        data_ranks, data_world = tuple((i,) for i in range(len(keep))), len(keep)
        rule = state.policy.elastic_lr_scaling  # the factor is against the launch's world, shrink after shrink
        before = state.lr_scale if rule == "linear" else state.lr_scale ** 2 if rule == "sqrt" else 1.0
        ratio = before * data_world / old_data_world
        lr_scale = 1.0 if rule == "none" else ratio if rule == "linear" else math.sqrt(ratio)
    return dict(world_size=len(keep), placement=tuple(state.agent_of(r) for r in keep), data_ranks=data_ranks,
                data_world_size=data_world, restore_ranks=tuple(keep), lr_scale=lr_scale)


def data_ranks_of(state: JobState) -> tuple[tuple[int, ...], ...]:
    """Each rank's data-parallel ranks now: (rank,) until the job first shrank."""
    return state.data_ranks or tuple((r,) for r in range(state.world_size))


def ranks_on(state: JobState, agent: int) -> list[int]:
    """The ranks ``agent`` hosts now, in order (their local ranks are their indices here)."""
    return [r for r in range(state.world_size) if state.agent_of(r) == agent]
