"""The recovery ladder: which strategy handles a fault, and why. Pure policy, no processes.

Rungs, cheapest first (DESIGN.md section 6). A rung is taken only when the job's
``--recover-strategy`` allows it and it is feasible for this fault right now; a rung
that fails or times out falls to the next one. ``exit`` (restart the whole job from the
newest complete checkpoint) is the usual last resort while restarts remain, as in
MindCluster, where a job that cannot be recovered in flight is rescheduled; like every
rung it is taken only when allowed: when no allowed rung is feasible the answer is
:data:`GIVE_UP` (the job fails, saying why).

The controller's state machine (:mod:`unbroken.controller.machine`) gathers what it knows of a
fault into :class:`FaultFacts`, asks :func:`choose`, and carries out the :class:`Decision`.
Every rule of the ladder and every reason it gives is here; the machine decides nothing of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from unbroken.errors import EXIT_FATAL
from unbroken.names import IN_FLIGHT_RUNGS, REPLACING_RUNGS, RUNGS, Rung
from unbroken.recovery.policy import JobPolicy
from unbroken.recovery.replica_map import ReplicaMap
from unbroken.recovery.replicas import Replicas

GIVE_UP = "give-up"

#: Faults that leave every process usable: only state is damaged (rung `retry`, the seeds' UCE
#: and TRE). Any other pending fault rules `retry` out.
RETRY_KINDS = frozenset({"memory-fault", "non-finite", "sdc"})


@dataclass(frozen=True)
class FaultFacts:
    """What the controller knows of one fault when it asks the ladder (the machine gathers it)."""

    rank: int  # the failed rank (the lowest of a lost node's)
    kind: str  # Failure.kind: "crash", "exit", "hang", "fatal", "node-lost", a RETRY_KINDS one, "sub-health", ...
    what: str  # Failure.describe(): every reason starts with it
    world_size: int  # ranks in the job
    storage: bool = False  # a storage tier to dump to exists (--save)
    dead: frozenset[int] = frozenset()  # the ranks to replace: lost now, and in the recovery in progress
    last_lines: tuple[str, ...] = ()  # the failed rank's last output (crash loop, EXIT_FATAL)
    detail: str = ""  # sub-health: what the degraded rank reported
    replicas: Replicas | None = None  # who holds what (None: every rank holds everything)
    not_ready: tuple[int, ...] = ()  # ranks that committed no step through unbroken in this attempt
    not_in_flight: tuple[tuple[int, str], ...] = ()  # (rank, why its state cannot be recovered in flight)
    left_loop: tuple[int, ...] = ()  # ranks, not dead, already past their step loops (loop_end.py)
    recovering: str = ""  # the rung of the in-flight recovery in progress ("": none)
    tries: int = 1  # this in-flight try of the fault (after the one in progress, or one that did not hold)
    recurring_step: int | None = None  # the resume step of the last in-flight recovery, had it not held yet
    home_agents_up: bool = True  # the agents of the ranks lost now are connected (recover-in-place)
    standby: bool = False  # a standby agent is connected (recover)
    standbys: int = 0  # standby agents connected: a job restart moves each lost agent's ranks to one (exit)
    lost_agents: tuple[int, ...] = ()  # agents hosting ranks whose connection is gone
    restarts_used: int = 0
    repeats: int = 0  # episodes in a row with this same failure (recovery/crash_loop.py)


@dataclass(frozen=True)
class Decision:
    """The rung for a fault and why. With :data:`GIVE_UP` the job fails with ``exit_code``; for a
    sub-health report it means no rung is taken and training goes on (nobody was lost)."""

    rung: str
    reason: str
    kill: str = ""  # a retry-type fault that is not retried: kill the damaged rank, saying this; its exit
    #                 then takes the ladder
    exit_code: int = 1  # with GIVE_UP: 1 (a cluster manager may restart the job) or EXIT_FATAL (never)


def choose(facts: FaultFacts, policy: JobPolicy) -> Decision:
    """The ladder: the cheapest rung the job allows that can handle this fault now, and why."""
    if facts.kind == "fatal":  # the script said "do not restart me": no rung can help a deterministic error
        why = f"rank {facts.rank} exited with EXIT_FATAL ({EXIT_FATAL}: fatal error, not restarted): {_last(facts)}"
        return Decision(GIVE_UP, why, exit_code=EXIT_FATAL)
    if policy.crash_loop_limit and facts.repeats >= policy.crash_loop_limit:
        return Decision(GIVE_UP, f"crash loop: {facts.what}, the same failure {policy.crash_loop_limit} times in a "
                                 f"row ({_last(facts)!r}); restarting cannot help (--crash-loop-limit)")
    if facts.kind == "sub-health":
        return _sub_health(facts, policy)
    refusal = in_flight_refusal(facts, policy)
    in_flight, why = not refusal, refusal or "every piece of the lost ranks' state has a live replica"
    feasible = {Rung.RETRY: in_flight and facts.kind in RETRY_KINDS and not facts.recovering,
                Rung.RECOVER_IN_PLACE: in_flight and facts.home_agents_up,
                Rung.RECOVER: in_flight and facts.standby,
                Rung.DUMP: in_flight and facts.storage and facts.recovering != Rung.DUMP,
                Rung.EXIT: facts.restarts_used < policy.max_restarts and len(facts.lost_agents) <= facts.standbys}
    rung = choose_rung(policy.allowed, feasible)
    if facts.kind in RETRY_KINDS and rung != Rung.RETRY:  # the damaged process goes; its exit takes the ladder on
        return Decision(rung, f"{facts.what}; no retry ({why})",
                        kill=f"state damaged in memory, not repairable in place ({why})")
    return Decision(rung, _reason(rung, facts, policy, why))


def in_flight_refusal(facts: FaultFacts, policy: JobPolicy) -> str:
    """Why no in-flight rung can handle the fault ("": one can). In flight, every piece of the dead
    ranks' state needs a live holder, and every survivor must be able to redo a step with them."""
    if not policy.replicas_allowed:
        return "restoring from replicas is off (--no-replica-restore)"
    if facts.not_ready:
        return (f"ranks {list(facts.not_ready)} have not committed a step through unbroken in this attempt (that "
                "needs job.steps() with gradients reduced by job.all_reduce or ShardedOptimizer)")
    if facts.not_in_flight:
        rank, why = min(facts.not_in_flight)
        return f"rank {rank} cannot be recovered in flight: {why}"
    if facts.left_loop:  # the others are done: nobody to redo a step with
        return (f"ranks {list(facts.left_loop)} already left their step loops (training done there): no survivor "
                "can redo a step in flight")
    alive = frozenset(range(facts.world_size)) - facts.dead
    if not alive:
        return "no rank survived"
    replicas: Replicas = facts.replicas or ReplicaMap.full(facts.world_size)
    for rank in sorted(facts.dead):
        for piece in replicas.pieces_of(rank):
            if replicas.live_source(piece, alive) is None:
                return f"no live replica of {piece} of rank {rank} (holders {replicas.holders(piece)} all lost)"
    if facts.recurring_step is not None and facts.tries > policy.max_recurring:
        return (f"the in-flight recovery to step {facts.recurring_step} did not hold: a rank failed again before "
                f"every rank completed that step ({facts.tries - 1} in-flight recoveries of this fault, at most "
                f"{policy.max_recurring}: --max-recurring-recoveries)")
    if facts.tries > policy.max_recovery_tries:
        return f"{facts.tries - 1} in-flight tries used, at most {policy.max_recovery_tries}"
    return ""


def choose_rung(allowed: Sequence[str], feasible: Mapping[str, bool], *, after: str | None = None) -> str:
    """The first rung below ``after`` that is allowed and feasible; :data:`GIVE_UP` if none.

    ``feasible`` maps a rung to whether it can handle the fault at hand (missing: no).
    A rung that is not in ``allowed`` is never taken, however feasible.
    """
    start = RUNGS.index(after) + 1 if after else 0
    for rung in RUNGS[start:]:
        if rung in allowed and feasible.get(rung, False):
            return rung
    return GIVE_UP


def _sub_health(facts: FaultFacts, policy: JobPolicy) -> Decision:
    """A degraded rank under ``--sub-health-policy grace-exit``: nobody is lost, so every rank dumps
    its own state and the job restarts cleanly from it; without a storage tier, a clean restart."""
    what = f"{facts.what}: {facts.detail}"
    if facts.restarts_used >= policy.max_restarts:
        return Decision(GIVE_UP, f"{what}; no restart left, training goes on (--max-restarts)")
    if facts.storage and not facts.not_ready:
        return Decision(Rung.DUMP, f"{what}; every rank dumps its state, then the job restarts "
                                   "(--sub-health-policy grace-exit)")
    return Decision(Rung.EXIT, f"{what}; clean restart {facts.restarts_used + 1} of {policy.max_restarts} "
                               "(no storage tier to dump to: --save)")


def _reason(rung: str, facts: FaultFacts, policy: JobPolicy, why: str) -> str:
    """What the event log says of the rung taken (``why``: the in-flight verdict)."""
    if rung == Rung.RETRY:
        return f"{facts.what}; {why}; repairing rank {facts.rank} from replicas"
    if rung == Rung.DUMP:
        return f"{facts.what}; {why}; survivors dump the state, then the job restarts"
    if rung in REPLACING_RUNGS:
        return f"{facts.what}; {why}; replacing ranks {sorted(facts.dead)} (try {facts.tries})"
    if rung == GIVE_UP:
        return _why_no_rung(facts, policy, why)
    in_flight_rungs = IN_FLIGHT_RUNGS & set(policy.allowed)
    not_in_flight = f" ({', '.join(sorted(in_flight_rungs))}: no; {why})" if in_flight_rungs else ""
    return f"{facts.what}; restart {facts.restarts_used + 1} of {policy.max_restarts}{not_in_flight}"


def _why_no_rung(facts: FaultFacts, policy: JobPolicy, in_flight_why: str) -> str:
    """The true reason no allowed rung can handle a fault: the restart budget, agents lost with
    their ranks, or the allowed strategies."""
    allowed = policy.allowed
    if Rung.EXIT in allowed and facts.restarts_used >= policy.max_restarts:
        return f"restart budget spent ({facts.restarts_used} of --max-restarts {policy.max_restarts} used)"
    if facts.lost_agents:
        if not facts.standby:
            spare = "no standby agent to host their ranks (unbroken run --standby)"
        elif Rung.EXIT in allowed and 0 < facts.standbys < len(facts.lost_agents):
            spare = (f"{facts.standbys} standby agent(s) for {len(facts.lost_agents)} lost node(s): a job restart "
                     "needs one for each")
        elif Rung.RECOVER not in allowed:
            spare = f"rung recover (onto a standby agent) is not in --recover-strategy {','.join(allowed)}"
        else:
            spare = f"their ranks cannot move to a standby agent in flight: {in_flight_why}"
        return (f"the agent of node(s) {list(facts.lost_agents)} was lost, so the job cannot restart on all its "
                f"nodes; {spare}")
    if Rung.EXIT not in allowed:
        return (f"none of the allowed strategies ({', '.join(allowed)}; --recover-strategy) can handle this "
                f"fault ({in_flight_why}); add 'exit' to restart the job from its newest checkpoint")
    return f"no recovery rung is allowed and feasible (--recover-strategy {','.join(allowed)}; {in_flight_why})"


def _last(facts: FaultFacts) -> str:
    """The failed rank's last three output lines, on one line."""
    return " | ".join(line.strip() for line in facts.last_lines[-3:] if line.strip()) or "no output"
