"""A controller that takes the job over from a lost leader (issue 29): pure functions, no clocks.

With ``--controller-store``, the controller's bookkeeping lives in etcd
(:mod:`unbroken.consensus.durable`, mirrored by :mod:`unbroken.controller.durable_mirror`). When
the leading controller is lost, a seat in another agent wins the election and starts a new
controller from that state. What the new controller does is a **job restart from the memory tier**,
not an in-flight recovery: the surviving agents stopped their workers when their controller
vanished, and the new attempt's ranks restore the newest step every rank can load (their own
node's shared memory first, storage for the ranks whose node was lost: restore rounds of
:mod:`unbroken.controller.commits`). Nothing of the old attempt can act in the new one: its
workers are dead before their agents rejoin, and the attempt number moves on.

The new controller's state (:func:`resumed`): the durable fields of the last leader, phase
STARTING, attempt + 1, one restart of the budget used. Then, whenever an agent joins
(:func:`place`): once every host of the placement has rejoined, except the hosts declared
lost, and one standby agent per lost host is there, the lost hosts' ranks move to the standbys
and the attempt starts. The previous leader's node is lost at once (its agent hosted the
controller that is gone); any other host that does not rejoin within a window is lost too
(:func:`window_over`). With no standby for a lost host, or no restart left, the job fails with
the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from unbroken.consensus.durable import DurableState
from unbroken.controller.api import Failure, Finish, JobPhase, JobState, StartAttempt, StopAttempt
from unbroken.controller.durable_mirror import job_from_durable

__all__ = ["Takeover", "place", "resumed", "window_over"]


@dataclass(frozen=True)
class Takeover:
    """What a new leader knows of the one before: the state it left, and who is lost with it."""

    durable: DurableState
    lost: frozenset[int]  # agents lost with the previous leader (its own node), never let back in
    previous: str = ""  # the previous leader's seat name, for the event log


def resumed(fresh: JobState, durable: DurableState) -> JobState:
    """The new leader's first state: ``fresh`` with the last leader's durable fields, restarting."""
    state = job_from_durable(fresh, durable)
    return replace(state, phase=JobPhase.STARTING, attempt=durable.attempt + 1,
                   restarts_used=state.restarts_used + 1, gen=0, committed_step=-1)


def place(state: JobState, lost: frozenset[int]) -> tuple[JobState, list]:
    """Start the attempt if every host not ``lost`` rejoined and a standby stands in for each lost
    one (their ranks move there); else wait: (state, [])."""
    if state.phase is not JobPhase.STARTING:
        return state, []
    missing = state.hosts() - state.agents
    if missing - lost:
        return state, []  # a host that may still rejoin
    if state.restarts_used > state.policy.max_restarts:
        return _fail(state, missing, f"the controller was lost and the restart budget is spent "
                                     f"(--max-restarts {state.policy.max_restarts})")
    spares = sorted(state.standbys)
    if len(spares) < len(missing):
        return state, []  # a standby may still join
    moved = dict(zip(sorted(missing), spares))
    placement = tuple(moved.get(state.agent_of(r), state.agent_of(r)) for r in range(state.world_size))
    used = frozenset(moved.values())
    state = replace(state, phase=JobPhase.RUNNING, placement=placement, agents=state.agents | used,
                    standbys=state.standbys - used)
    return state, [StartAttempt(state.attempt)]


def window_over(state: JobState, lost: frozenset[int], window_s: float) -> tuple[JobState, list]:
    """The join window ended: every host still missing is lost; start, or fail saying why."""
    if state.phase is not JobPhase.STARTING:
        return state, []
    missing = state.hosts() - state.agents
    state, actions = place(state, lost | missing)
    if actions or state.phase is not JobPhase.STARTING:
        return state, actions
    lost_now = sorted(missing | (lost & state.hosts()))
    return _fail(state, frozenset(lost_now),
                 f"the agents of nodes {lost_now} were lost with the previous controller or did not rejoin the new "
                 f"one within {window_s:g} s, and {len(state.standbys)} standby agent(s) joined to host their ranks "
                 "(start one with `unbroken run --standby`, or use --nnodes with nodes to spare)")


def _fail(state: JobState, lost: frozenset[int], why: str) -> tuple[JobState, list]:
    ranks = [r for r in range(state.world_size) if state.agent_of(r) in lost] or [0]
    failure = Failure(rank=min(ranks), attempt=state.attempt, kind="node-lost")
    state = replace(state, phase=JobPhase.FAILED, first_failure=state.first_failure or failure,
                    failures=state.failures + (failure,))
    return state, [StopAttempt(state.attempt, why), Finish(1, f"{why}; root cause: {failure.describe()}")]
