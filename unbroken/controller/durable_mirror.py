"""The controller's state machine state <-> its durable part in etcd (pure functions; the
store is :mod:`unbroken.consensus.durable`).

:func:`durable_from_job` takes what a new leader must not lose out of a
:class:`~unbroken.controller.api.JobState`; :func:`job_from_durable` puts it back into a fresh
one (the rest -- who is connected, who is ready, the phase -- is rebuilt from the agents and
workers that reconnect). The replica map is written out rank by rank (who holds an identical
copy of what the rank holds), so a reader needs no knowledge of the layouts; the fields that
produce it (``num_replicas``, the mesh) are carried too, so a new leader rebuilds the same map.
"""

from __future__ import annotations

from dataclasses import replace

from unbroken.consensus.durable import DurableState
from unbroken.controller.api import FINAL_PHASES, JobState
from unbroken.recovery.replicas import holders_of_all, job_replicas

__all__ = ["agent_name", "durable_from_job", "job_from_durable", "layout_key", "replica_map_of"]


def agent_name(agent: int) -> str:
    """How the durable state names the agent (node slot) holding a rank's own state."""
    return f"agent{agent}"


def replica_map_of(state: JobState) -> dict[int, tuple[int, ...]]:
    """rank -> every rank holding all that ``rank`` holds (itself included), ascending. Computed once
    per set of pieces held, and shared by the ranks holding that set: a fully replicated job of N ranks
    is one tuple of N, not N of them (N^2: 1 s and 2.8 MB at 1,024 ranks)."""
    replicas = job_replicas(state.world_size, state.num_replicas, state.mesh, state.mesh_replicate)
    by_pieces: dict[frozenset, tuple[int, ...]] = {}
    out = {}
    for rank in range(state.world_size):
        held = frozenset(replicas.pieces_of(rank))
        if not held:
            out[rank] = (rank,)
            continue
        if held not in by_pieces:
            by_pieces[held] = holders_of_all(replicas, rank)
        out[rank] = by_pieces[held]
    return out


def layout_key(state: JobState) -> tuple:
    """What the durable state holds besides the committed step: when it is unchanged, a committed
    step writes only the step (:meth:`~unbroken.consensus.durable.DurableStore.save`)."""
    return (state.attempt, state.gen, state.restarts_used, state.placement, state.num_replicas, state.mesh,
            state.mesh_replicate, state.phase in FINAL_PHASES)


def durable_from_job(state: JobState) -> DurableState:
    return DurableState(
        attempt=state.attempt, generation=state.gen, committed_step=state.committed_step,
        restart_budget=max(0, state.policy.max_restarts - state.restarts_used),
        replica_map=replica_map_of(state),
        rank_state_at={rank: agent_name(state.agent_of(rank)) for rank in range(state.world_size)},
        num_replicas=state.num_replicas, mesh=state.mesh, mesh_replicate=state.mesh_replicate)


def job_from_durable(fresh: JobState, durable: DurableState) -> JobState:
    """A new leader's starting state: ``fresh`` (the job's policy and shape, as a controller starts)
    with the durable fields of the last leader, nothing else."""
    if durable.rank_state_at and sorted(durable.rank_state_at) != list(range(fresh.world_size)):
        raise ValueError(f"the durable state in etcd places ranks {sorted(durable.rank_state_at)}, "
                         f"but this job has world size {fresh.world_size}: is it the same job?")
    placement = tuple(int(durable.rank_state_at[r].removeprefix("agent")) for r in sorted(durable.rank_state_at))
    policy = fresh.policy
    return replace(fresh, attempt=durable.attempt, gen=durable.generation,
                   committed_step=durable.committed_step,
                   restarts_used=max(0, policy.max_restarts - durable.restart_budget),
                   placement=placement, num_replicas=durable.num_replicas, mesh=durable.mesh,
                   mesh_replicate=durable.mesh_replicate)
