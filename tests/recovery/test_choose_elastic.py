"""Rung `elastic` in the ladder, table-driven: a node is lost, no standby can host its ranks, and the job
goes on on the nodes left (controller/elastic.py), or is refused with the reason it cannot (milliseconds,
no processes).

Each row starts from node 1 of 2 (ranks 2 and 3 of 4) lost, full replication, every rank ready and
splitting its batch by job.data_ranks(), strategies ``elastic,exit``; it changes only what it is about."""

from __future__ import annotations

import dataclasses

import pytest

from unbroken.errors import ConfigError
from unbroken.names import Rung
from unbroken.recovery.ladder import GIVE_UP, Decision, FaultFacts, choose, elastic_refusal
from unbroken.recovery.policy import JobPolicy
from unbroken.recovery.replica_map import ReplicaMap

WHAT = "rank 2 lost with its node at step 5, attempt 0"
POLICY = JobPolicy(max_restarts=3, allowed=(Rung.RECOVER, Rung.ELASTIC, Rung.EXIT))
FACTS = FaultFacts(rank=2, kind="node-lost", what=WHAT, world_size=4, dead=frozenset({2, 3}),
                   replicas=ReplicaMap.full(4), home_agents_up=False, lost_agents=(1,), nodes_left=1)
EXACT = ("the job goes on without node(s) [1] on the 1 node(s) left, from their newest snapshot; the survivors also "
         "run the lost ranks' micro-batches: same global batch and sample order")
FAST = ("the job goes on without node(s) [1] on the 1 node(s) left, from their newest snapshot; a smaller global "
        "batch (--elastic-mode fast)")
LOST = "the agent of node(s) [1] was lost, so the job cannot restart on all its nodes; "
NO_ELASTIC = LOST + "no standby agent to host their ranks (unbroken run --standby), and rung elastic cannot go on " \
                    "without them: "
NO_API = "the script never called job.data_ranks() in its steps"


def row(name, rung, reason, *, policy=None, **facts):
    return pytest.param(facts, policy or {}, Decision(rung, reason), id=name)


ROWS = [
    row("exact", Rung.ELASTIC, f"{WHAT}; {EXACT}"),
    row("fast", Rung.ELASTIC, f"{WHAT}; {FAST}", policy={"elastic_mode": "fast"}),
    row("a-standby-comes-first", Rung.RECOVER,
        f"{WHAT}; every piece of the lost ranks' state has a live replica; replacing ranks [2, 3] (try 1)",
        standby=True),
    row("two-of-three-nodes-left", Rung.ELASTIC, f"{WHAT}; " + EXACT.replace("on the 1 node(s)", "on the 2 node(s)"),
        world_size=6, nodes_left=2),
    row("min-nodes", GIVE_UP, NO_ELASTIC + "1 node(s) left, fewer than --min-nodes 2", policy={"min_nodes": 2}),
    row("no-restart-left", GIVE_UP, "restart budget spent (3 of --max-restarts 3 used)",
        restarts_used=3),
    row("tensor-parallel", GIVE_UP, NO_ELASTIC + "the job's mesh (dp=2 x tp=2) has dimensions other than its "
        "data-parallel one (dp); only a pure data-parallel job can shrink", mesh=(("dp", 2), ("tp", 2)),
        mesh_replicate="dp"),
    row("data-parallel-mesh", Rung.ELASTIC, f"{WHAT}; {EXACT}", mesh=(("dp", 4), ("tp", 1)), mesh_replicate="dp"),
    row("sharded-optimizer", GIVE_UP, NO_ELASTIC + "its ShardedOptimizer shards the optimizer state over 4 ranks "
        "(2 copies each); re-sharding it onto fewer ranks is not built", num_replicas=2),
    row("sharded-optimizer-fast-too", GIVE_UP, NO_ELASTIC + "its ShardedOptimizer shards the optimizer state over 4 "
        "ranks (2 copies each); re-sharding it onto fewer ranks is not built", num_replicas=2,
        policy={"elastic_mode": "fast"}),
    row("exact-needs-the-api", GIVE_UP, NO_ELASTIC + f"rank 1 cannot keep the global batch on fewer ranks: {NO_API} "
        "(--elastic-mode exact)", not_exact=((3, NO_API), (1, NO_API))),
    row("fast-does-not", Rung.ELASTIC, f"{WHAT}; {FAST}", not_exact=((1, NO_API),), policy={"elastic_mode": "fast"}),
    row("exact-not-ready", GIVE_UP, NO_ELASTIC + "ranks [0] have not committed a step through unbroken in this "
        "attempt, so it is not known whether they split their batch by job.data_ranks() (--elastic-mode exact)",
        not_ready=(0,)),
    row("fast-not-ready", Rung.ELASTIC, f"{WHAT}; {FAST}", not_ready=(0,), policy={"elastic_mode": "fast"}),
    row("elastic-not-allowed", GIVE_UP, LOST + "no standby agent to host their ranks (unbroken run --standby), and "
        "rung elastic (go on without them) is not in --recover-strategy",
        policy={"allowed": (Rung.RECOVER, Rung.EXIT)}),
    row("standby-but-not-in-flight", GIVE_UP, LOST + "their ranks cannot move to a standby agent in flight "
        "(restoring from replicas is off (--no-replica-restore)), and rung elastic cannot go on without them: "
        "1 node(s) left, fewer than --min-nodes 2", standby=True,
        policy={"replicas_allowed": False, "min_nodes": 2}),
]


@pytest.mark.parametrize(("facts", "policy", "expected"), ROWS)
def test_choose_elastic(facts, policy, expected):
    assert choose(dataclasses.replace(FACTS, **facts), dataclasses.replace(POLICY, **policy)) == expected


def test_a_lost_process_is_never_handled_by_elastic():
    """A crash on a live node is replaced in flight or restarts the job; elastic drops whole nodes only."""
    facts = dataclasses.replace(FACTS, kind="crash", lost_agents=(), home_agents_up=True, nodes_left=2)
    assert elastic_refusal(facts, POLICY).startswith("no node was lost")
    assert choose(facts, POLICY).rung == Rung.EXIT


@pytest.mark.parametrize(("fields", "message"), [
    ({"elastic_mode": "slow"}, "--elastic-mode: unknown mode 'slow' (allowed: exact, fast)"),
    ({"min_nodes": 0}, "--min-nodes must be >= 1, got 0"),
    ({"elastic_mode": "fast", "elastic_lr_scaling": "cube"}, "--elastic-lr-scaling: unknown rule 'cube'"),
    ({"elastic_lr_scaling": "linear"}, "--elastic-lr-scaling linear needs --elastic-mode fast"),
])
def test_the_policy_refuses_bad_elastic_settings(fields, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        JobPolicy(**fields)
