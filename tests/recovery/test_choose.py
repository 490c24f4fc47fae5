"""The recovery ladder, table-driven: one row per (facts, policy) -> (rung, reason), for every rung
and every reason a rung is refused (milliseconds, no processes, no state machine).

Each row starts from one fault, a crash of rank 2 of 4 with full replication, every strategy
allowed and a storage tier, and changes only what the row is about."""

from __future__ import annotations

import dataclasses

import pytest

from unbroken.errors import EXIT_FATAL
from unbroken.names import Rung
from unbroken.recovery.ladder import GIVE_UP, Decision, FaultFacts, choose, in_flight_refusal
from unbroken.recovery.mesh_map import MeshReplicaMap
from unbroken.recovery.policy import JobPolicy
from unbroken.recovery.replica_map import ReplicaMap

WHAT = "rank 2 crashed (exit code 1) at step 5, attempt 0"
LIVE = "every piece of the lost ranks' state has a live replica"
ALL = (Rung.RETRY, Rung.RECOVER_IN_PLACE, Rung.RECOVER, Rung.DUMP, Rung.EXIT)
POLICY = JobPolicy(max_restarts=3, allowed=ALL)
FACTS = FaultFacts(rank=2, kind="crash", what=WHAT, world_size=4, storage=True, dead=frozenset({2}),
                   replicas=ReplicaMap.full(4))
NOT_IN_FLIGHT = "dump, recover, recover-in-place, retry: no"  # the exit reason names the in-flight rungs refused
NO_DDP = "it tracks a DistributedDataParallel module"
NOT_READY = ("ranks [0, 1] have not committed a step through unbroken in this attempt (that needs job.steps() "
             "with gradients reduced by job.all_reduce or ShardedOptimizer)")
NO_REPLICAS = "restoring from replicas is off (--no-replica-restore)"
DAMAGED = "state damaged in memory, not repairable in place"
DUMP_AGAIN = {"recovering": Rung.DUMP, "home_agents_up": False}


def row(name, rung, reason, *, kill="", exit_code=1, policy=None, **facts):
    return pytest.param(facts, policy or {}, Decision(rung, reason, kill, exit_code), id=name)


ROWS = [
    # -- retry: only state is damaged, no process exits
    row("retry", Rung.RETRY, f"{WHAT}; {LIVE}; repairing rank 2 from replicas", kind="memory-fault"),
    row("retry-non-finite", Rung.RETRY, f"{WHAT}; {LIVE}; repairing rank 2 from replicas", kind="non-finite"),
    row("no-retry-during-a-recovery", Rung.RECOVER_IN_PLACE, f"{WHAT}; no retry ({LIVE})", kill=f"{DAMAGED} ({LIVE})",
        kind="sdc", recovering=Rung.RECOVER_IN_PLACE),
    row("no-retry-not-allowed", Rung.RECOVER_IN_PLACE, f"{WHAT}; no retry ({LIVE})", kill=f"{DAMAGED} ({LIVE})",
        kind="memory-fault", policy={"allowed": (Rung.RECOVER_IN_PLACE, Rung.EXIT)}),
    row("no-retry-no-replicas", GIVE_UP, f"{WHAT}; no retry ({NO_REPLICAS})", kill=f"{DAMAGED} ({NO_REPLICAS})",
        kind="memory-fault", policy={"allowed": (Rung.RETRY,), "replicas_allowed": False}),
    row("a-crash-is-never-retried", Rung.RECOVER_IN_PLACE, f"{WHAT}; {LIVE}; replacing ranks [2] (try 1)"),
    # -- recover-in-place: a new process on the rank's own agent; survivors wait
    row("recover-in-place", Rung.RECOVER_IN_PLACE, f"{WHAT}; {LIVE}; replacing ranks [2] (try 1)"),
    row("recover-in-place-again", Rung.RECOVER_IN_PLACE, f"{WHAT}; {LIVE}; replacing ranks [1, 2] (try 2)",
        recovering=Rung.RECOVER_IN_PLACE, dead=frozenset({1, 2}), tries=2),
    row("held-recovery-starts-afresh", Rung.RECOVER_IN_PLACE, f"{WHAT}; {LIVE}; replacing ranks [2] (try 1)",
        recurring_step=None, tries=1),
    row("recurring-within-its-bound", Rung.RECOVER_IN_PLACE, f"{WHAT}; {LIVE}; replacing ranks [2] (try 2)",
        recurring_step=61, tries=2),
    # -- recover: the rank's agent is gone, a standby agent hosts it
    row("recover", Rung.RECOVER, f"{WHAT}; {LIVE}; replacing ranks [2] (try 1)", home_agents_up=False, standby=True),
    # -- dump: nowhere to restart in flight, survivors write one consistent copy
    row("dump", Rung.DUMP, f"{WHAT}; {LIVE}; survivors dump the state, then the job restarts", home_agents_up=False),
    row("no-second-dump", Rung.EXIT, f"{WHAT}; restart 1 of 3 ({NOT_IN_FLIGHT}; {LIVE})", **DUMP_AGAIN),
    row("no-dump-without-storage", Rung.EXIT, f"{WHAT}; restart 1 of 3 ({NOT_IN_FLIGHT}; {LIVE})",
        home_agents_up=False, storage=False),
    # -- exit: a job restart, and every reason the in-flight rungs are refused
    row("exit-only", Rung.EXIT, f"{WHAT}; restart 1 of 3", policy={"allowed": (Rung.EXIT,)}),
    row("exit-second-restart", Rung.EXIT, f"{WHAT}; restart 3 of 3", restarts_used=2, policy={"allowed": (Rung.EXIT,)}),
    row("refused-no-replica-restore", Rung.EXIT, f"{WHAT}; restart 1 of 3 ({NOT_IN_FLIGHT}; {NO_REPLICAS})",
        policy={"replicas_allowed": False}),
    row("refused-not-ready", Rung.EXIT, f"{WHAT}; restart 1 of 3 ({NOT_IN_FLIGHT}; {NOT_READY})", not_ready=(0, 1)),
    row("refused-not-in-flight", Rung.EXIT,
        f"{WHAT}; restart 1 of 3 ({NOT_IN_FLIGHT}; rank 1 cannot be recovered in flight: {NO_DDP})",
        not_in_flight=((3, "no replica map"), (1, NO_DDP))),
    row("refused-left-the-loop", Rung.EXIT,
        f"{WHAT}; restart 1 of 3 ({NOT_IN_FLIGHT}; ranks [0, 1, 3] already left their step loops (training done "
        "there): no survivor can redo a step in flight)", left_loop=(0, 1, 3)),
    row("refused-nobody-survived", Rung.EXIT, f"{WHAT}; restart 1 of 3 ({NOT_IN_FLIGHT}; no rank survived)",
        dead=frozenset(range(4))),
    row("refused-shard-lost", Rung.EXIT, f"{WHAT}; restart 1 of 3 ({NOT_IN_FLIGHT}; no live replica of optimizer "
        "shard 0 of rank 0 (holders [0, 2] all lost))", dead=frozenset({0, 2}), replicas=ReplicaMap(4, 2)),
    row("refused-mesh-piece-lost", Rung.EXIT, f"{WHAT}; restart 1 of 3 ({NOT_IN_FLIGHT}; no live replica of the "
        "state of tp=0 of rank 0 (holders [0, 2] all lost))", dead=frozenset({0, 2}),
        replicas=MeshReplicaMap((("dp", 2), ("tp", 2)), "dp")),
    row("refused-recurring", Rung.EXIT, f"{WHAT}; restart 1 of 3 ({NOT_IN_FLIGHT}; the in-flight recovery to step 61 "
        "did not hold: a rank failed again before every rank completed that step (2 in-flight recoveries of this "
        "fault, at most 2: --max-recurring-recoveries))", recurring_step=61, tries=3),
    row("refused-tries-spent", Rung.EXIT,
        f"{WHAT}; restart 1 of 3 ({NOT_IN_FLIGHT}; 3 in-flight tries used, at most 3)",
        recovering=Rung.RECOVER_IN_PLACE, tries=4),
    # -- give up: no allowed rung is feasible; the job fails (exit code 1)
    row("budget-spent", GIVE_UP, "restart budget spent (3 of --max-restarts 3 used)",
        restarts_used=3, policy={"replicas_allowed": False}),
    row("node-lost-no-standby", GIVE_UP, "the agent of node(s) [1] was lost, so the job cannot restart on all its "
        "nodes; no standby agent to host their ranks (unbroken run --standby)",
        kind="node-lost", home_agents_up=False, lost_agents=(1,), storage=False),
    row("node-lost-recover-not-allowed", GIVE_UP, "the agent of node(s) [1] was lost, so the job cannot restart on "
        "all its nodes; rung recover (onto a standby agent) is not in --recover-strategy recover-in-place,exit",
        kind="node-lost", home_agents_up=False, lost_agents=(1,), standby=True,
        policy={"allowed": (Rung.RECOVER_IN_PLACE, Rung.EXIT)}),
    row("node-lost-exit-onto-standby", Rung.EXIT, "node 1 lost; restart 1 of 3 (dump, recover, recover-in-place, "
        "retry: no; restoring from replicas is off (--no-replica-restore))", kind="node-lost", what="node 1 lost",
        home_agents_up=False, lost_agents=(1,), standby=True, standbys=1, policy={"replicas_allowed": False}),
    row("node-lost-too-few-standbys", GIVE_UP, "the agent of node(s) [1, 2] was lost, so the job cannot restart on "
        "all its nodes; 1 standby agent(s) for 2 lost node(s): a job restart needs one for each",
        kind="node-lost", home_agents_up=False, lost_agents=(1, 2), standby=True, standbys=1,
        policy={"allowed": (Rung.RECOVER_IN_PLACE, Rung.EXIT)}),
    row("node-lost-not-in-flight", GIVE_UP, "the agent of node(s) [1] was lost, so the job cannot restart on all its "
        f"nodes; their ranks cannot move to a standby agent in flight: {NO_REPLICAS}",
        kind="node-lost", home_agents_up=False, lost_agents=(1,), standby=True, policy={"replicas_allowed": False}),
    row("exit-not-allowed", GIVE_UP, f"none of the allowed strategies (recover-in-place; --recover-strategy) can "
        f"handle this fault ({NOT_READY}); add 'exit' to restart the job from its newest checkpoint",
        not_ready=(0, 1), policy={"allowed": (Rung.RECOVER_IN_PLACE,)}),
    row("tries-spent-exit-not-allowed", GIVE_UP, "none of the allowed strategies (recover-in-place; "
        "--recover-strategy) can handle this fault (3 in-flight tries used, at most 3); add 'exit' to restart the "
        "job from its newest checkpoint", tries=4, policy={"allowed": (Rung.RECOVER_IN_PLACE,)}),
    # -- EXIT_FATAL and the crash loop: no rung can help
    row("fatal", GIVE_UP, "rank 2 exited with EXIT_FATAL (97: fatal error, not restarted): Traceback | ValueError: x",
        exit_code=EXIT_FATAL, kind="fatal", last_lines=("", "Traceback", "  ", "ValueError: x")),
    row("fatal-silent", GIVE_UP, "rank 2 exited with EXIT_FATAL (97: fatal error, not restarted): no output",
        exit_code=EXIT_FATAL, kind="fatal"),
    row("crash-loop", GIVE_UP, f"crash loop: {WHAT}, the same failure 3 times in a row ('a | b | boom'); restarting "
        "cannot help (--crash-loop-limit)", repeats=3, last_lines=("z", "a", "b", "boom")),
    row("crash-loop-silent", GIVE_UP, f"crash loop: {WHAT}, the same failure 2 times in a row ('no output'); "
        "restarting cannot help (--crash-loop-limit)", repeats=2, policy={"crash_loop_limit": 2}),
    row("crash-loop-not-yet", Rung.RECOVER_IN_PLACE, f"{WHAT}; {LIVE}; replacing ranks [2] (try 1)", repeats=2),
    row("crash-loop-off", Rung.RECOVER_IN_PLACE, f"{WHAT}; {LIVE}; replacing ranks [2] (try 1)", repeats=9,
        policy={"crash_loop_limit": 0}),
    # -- sub-health (--sub-health-policy grace-exit): nobody is lost
    row("sub-health-dump", Rung.DUMP, f"{WHAT}: ecc; every rank dumps its state, then the job restarts "
        "(--sub-health-policy grace-exit)", kind="sub-health", detail="ecc"),
    row("sub-health-no-storage", Rung.EXIT, f"{WHAT}: ecc; clean restart 1 of 3 (no storage tier to dump to: --save)",
        kind="sub-health", detail="ecc", storage=False),
    row("sub-health-not-ready", Rung.EXIT, f"{WHAT}: ecc; clean restart 2 of 3 (no storage tier to dump to: --save)",
        kind="sub-health", detail="ecc", not_ready=(1,), restarts_used=1),
    row("sub-health-no-restart-left", GIVE_UP, f"{WHAT}: ecc; no restart left, training goes on (--max-restarts)",
        kind="sub-health", detail="ecc", restarts_used=3),
]


@pytest.mark.parametrize(("facts", "policy", "expected"), ROWS)
def test_choose(facts, policy, expected):
    assert choose(dataclasses.replace(FACTS, **facts), dataclasses.replace(POLICY, **policy)) == expected


def test_the_table_takes_every_rung_and_every_way_to_give_up():
    decisions = [p.values[2] for p in ROWS]
    assert {d.rung for d in decisions} == {*ALL, GIVE_UP}
    assert {d.exit_code for d in decisions if d.rung == GIVE_UP} == {1, EXIT_FATAL}
    assert any(d.kill for d in decisions) and any(d.kill for d in decisions if d.rung == GIVE_UP)


def test_the_table_meets_every_reason_an_in_flight_rung_is_refused():
    """Each row's in-flight verdict: every refusal in_flight_refusal gives appears in some row."""
    verdicts = [in_flight_refusal(dataclasses.replace(FACTS, **p.values[0]), dataclasses.replace(POLICY, **p.values[1]))
                for p in ROWS]
    assert "" in verdicts  # in flight is possible
    for start in (NO_REPLICAS, NOT_READY, "rank 1 cannot be recovered in flight", "ranks [0, 1, 3] already left",
                  "no rank survived", "no live replica of optimizer shard 0 of rank 0",
                  "no live replica of the state of tp=0 of rank 0", "the in-flight recovery to step 61 did not hold",
                  "3 in-flight tries used, at most 3"):
        assert any(v.startswith(start) for v in verdicts), start


def test_a_rung_the_job_does_not_allow_is_never_taken_whatever_the_facts():
    for p in ROWS:
        facts, policy = dataclasses.replace(FACTS, **p.values[0]), dataclasses.replace(POLICY, **p.values[1])
        for allowed in [(Rung.RETRY,), (Rung.DUMP,), (Rung.EXIT,), (Rung.RECOVER, Rung.EXIT)]:
            decision = choose(facts, dataclasses.replace(policy, allowed=allowed))
            if facts.kind != "sub-health":  # a degraded rank restarts cleanly whatever is allowed (machine.py)
                assert decision.rung in (*allowed, GIVE_UP), (p.id, allowed, decision)
