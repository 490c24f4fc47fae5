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

*Scale-out* (:func:`on_joined`, :func:`grow`): once every node of the launch is there again (the lost
node's agent came back, or a standby agent stands in for it), the job grows back to the launch's shape
at a committed step: another job restart, at the launch's world and placement, one data rank each
(exact mode: the fault-free run's assignment; fast mode: ``lr_scale`` 1). Each surviving rank restores
the snapshot it wrote under its shrunk number (``restore_ranks``); a rank taken in has none, so its
agent first fetches a surviving rank's two newest snapshots from that rank's node over the
authenticated peer-memory channel (``fetch_from``: agent/peer_memory.py). Full replication makes that
rank's state its own (the ladder refuses sharded layouts; exact mode refuses per-rank state). The grow
waits until the shrunk world committed a snapshot of its own (``snapshot_every``), and if the ranks
taken in still end up with no state (the restore finds no common step), :func:`check_restore` goes
back to the shrunk shape instead of a fresh start: never a rank on fresh weights.
"""

from __future__ import annotations

import math

from unbroken.controller.api import (Decide, Failure, JobPhase, JobState, RestoreDecided, ScaleOut, ScaleOutRefused,
                                     Shape, StopAttempt)
from unbroken.controller.values import replace
from unbroken.recovery.ladder import Decision, FaultFacts


def shrink(state: JobState, failure: Failure, decision: Decision, facts: FaultFacts) -> tuple[JobState, list]:
    """Stop the surviving nodes' workers; the next attempt (machine's ``_on_agent_stopped``) starts the
    smaller world this returns the shape of."""
    lost = set(facts.lost_agents)
    keep = [r for r in range(state.world_size) if state.agent_of(r) not in lost]
    launch = state.launch_placement or tuple(state.agent_of(r) for r in range(state.world_size))
    state = replace(state, **new_shape(state, keep), phase=JobPhase.STOPPING, stopped_agents=frozenset(),
                    recovery=None, launch_placement=launch, fetch_from=(), growing=None)
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


# -- scale-out -----------------------------------------------------------------------------------
def shrunk(state: JobState) -> bool:
    """The job runs smaller than it was launched (rung elastic shrank it)."""
    return bool(state.launch_placement) and state.world_size < len(state.launch_placement)


def on_joined(state: JobState, agent: int) -> list:
    """An agent (a node's, or a standby) joined a shrunk job: why it cannot be taken in, said once, if
    it never can; nothing otherwise (the job grows back at the next committed step it can: :func:`grow`)."""
    why = _never(state)
    return [ScaleOutRefused(state.world_size, (agent,), why)] if why and shrunk(state) else []


def _never(state: JobState) -> str:
    """Why this job cannot grow back at all ("": it can)."""
    if not state.policy.scale_out:
        return "--no-scale-out: the job trains on at its smaller size"
    if not state.snapshot_every:
        return ("the ranks taken in would have no state: scale-out fetches a surviving rank's memory-tier "
                "snapshot from its node, and this job keeps none a peer can fetch (--ckpt-every-steps 0 or "
                "--no-peer-memory); the job trains on at its smaller size")
    if state.restarts_used >= state.policy.max_restarts:
        return (f"restart budget spent ({state.restarts_used} of --max-restarts {state.policy.max_restarts} "
                "used); the job trains on at its smaller size")
    return ""


def _targets(state: JobState) -> dict[int, int] | None:
    """Each agent of the launch -> the agent that hosts its ranks once grown (itself, back; or a standby);
    None while some lost one has neither."""
    hosting, spare = state.hosts(), sorted(state.standbys - state.no_grow)
    moved = {}
    for agent in sorted(set(state.launch_placement)):
        if agent in hosting or (agent in state.agents and agent not in state.no_grow):
            moved[agent] = agent
        elif spare:
            moved[agent] = spare.pop(0)
        else:
            return None
    return moved


def _snapshot_settled(state: JobState) -> bool:
    """Every rank of the shrunk world committed a memory-tier snapshot under its own (shrunk) number: the
    first snapshot after the attempt's restore, two commits later (it is settled before the next step's
    update and committed by a thread after it)."""
    rounds = state.restore
    if rounds.attempt != state.attempt or not rounds.decided or rounds.decided[-1][1] < 0:
        return False
    every = state.snapshot_every
    first = (rounds.decided[-1][1] // every + 1) * every  # steps done at the first snapshot
    return state.committed_step >= first + 1


def grow(state: JobState) -> tuple[JobState, list]:
    """At a committed step (the machine's ``_on_step_synced``): grow back to the launch's shape if every
    condition holds now; the state unchanged and no action otherwise."""
    if (not shrunk(state) or state.phase is not JobPhase.RUNNING or state.recovery is not None
            or state.unconfirmed is not None or state.terminating or state.growing is not None or _never(state)
            or not _snapshot_settled(state)):
        return state, []
    moved = _targets(state)
    if moved is None:
        return state, []
    placement = tuple(moved[a] for a in state.launch_placement)
    survivors = {a: ranks_on(state, a) for a in state.hosts()}  # shrunk ranks by agent, in rank order
    joining = sorted(set(moved.values()) - set(survivors))
    restore, fetch, taken = [], [], 0
    for rank, agent in enumerate(placement):
        if agent in survivors:  # the snapshot it wrote under its shrunk number
            restore.append(survivors[agent][sum(1 for a in placement[:rank] if a == agent)])
            fetch.append((-1, -1))
        else:  # none of its own: a surviving rank's (every rank holds the same state), spread over them
            source = taken % state.world_size
            taken += 1
            restore.append(-1)
            fetch.append((state.agent_of(source), source))
    before = Shape(state.world_size, tuple(state.agent_of(r) for r in range(state.world_size)), state.data_ranks,
                   state.data_world_size, state.lr_scale, frozenset(joining))
    reason = (f"every node of the launch is there again (agents {joining} taken in): the job grows back from "
              f"{state.world_size} to {len(placement)} ranks at committed step {state.committed_step}, "
              + ("each rank on its own data shard again (--elastic-mode exact: the fault-free run's batch)"
                 if state.policy.elastic_mode == "exact" else "the learning-rate factor back to 1 (--elastic-mode "
                 "fast)") + "; the ranks taken in fetch a surviving rank's snapshot from its node's memory")
    actions = [ScaleOut(state.world_size, len(placement), tuple(joining), state.committed_step, reason),
               StopAttempt(state.attempt, f"scale-out to {len(placement)} ranks")]
    spares = frozenset(joining) & state.standbys
    state = replace(state, world_size=len(placement), placement=placement, data_ranks=(), data_world_size=0,
                    lr_scale=1.0, restore_ranks=tuple(restore), fetch_from=tuple(fetch), growing=before,
                    standbys=state.standbys - spares, agents=state.agents | spares,
                    phase=JobPhase.STOPPING, stopped_agents=frozenset())
    return state, actions


def check_restore(state: JobState, actions: list) -> tuple[JobState, list]:
    """After a restore decision (unbroken.controller.commits): the first attempt after a scale-out holds
    once its ranks restored a step; if they found none in common (the ranks taken in got no state), the
    job goes back to its shrunk shape, saying why, instead of starting every rank fresh."""
    decided = [a for a in actions if isinstance(a, RestoreDecided)]
    if state.growing is None or not decided or decided[0].attempt != state.attempt:
        return state, actions
    if decided[0].point.step >= 0:
        return replace(state, growing=None, fetch_from=()), actions
    return undo_grow(state, f"the restore found no step every rank can load ({decided[0].point.reason})")


def undo_grow(state: JobState, why: str) -> tuple[JobState, list]:
    """Back to the shape before the scale-out in progress (its ranks restore their own shrunk snapshots:
    the grow waited for them); the agents it took in are not taken in again until they rejoin."""
    before = state.growing
    joining = tuple(sorted(before.joining))
    state = replace(state, world_size=before.world_size, placement=before.placement, data_ranks=before.data_ranks,
                    data_world_size=before.data_world_size, lr_scale=before.lr_scale, restore_ranks=(),
                    fetch_from=(), growing=None, no_grow=state.no_grow | before.joining,
                    phase=JobPhase.STOPPING, stopped_agents=frozenset())
    reason = f"scale-out undone: {why}; the job goes on at {before.world_size} ranks"
    return state, [ScaleOutRefused(before.world_size, joining, reason), StopAttempt(state.attempt, reason)]
