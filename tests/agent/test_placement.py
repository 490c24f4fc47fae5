"""The agent's restart bookkeeping (Placement): pure, milliseconds."""

from __future__ import annotations

from unbroken.agent.placement import Placement
from unbroken.protocol import messages as m


def test_a_node_runs_its_own_ranks_with_local_ranks_from_zero():
    p = Placement(node_rank=1, nproc_per_node=2, standby=False)
    ranks = p.start(m.StartRanks(attempt=0, store_host="h", store_port=5, world_size=4, store_prefix="k1"))
    assert ranks == [2, 3] and [p.local_rank(r) for r in ranks] == [0, 1]
    assert (p.store_addr, p.store_prefix, p.world_size) == (("h", 5), "k1", 4)


def test_an_order_naming_ranks_overrides_the_nodes_own():
    p = Placement(node_rank=0, nproc_per_node=2, standby=False)
    assert p.start(m.StartRanks(attempt=1, store_host="h", store_port=5, world_size=4, ranks=[1])) == [1]


def test_a_restart_keeps_the_store_and_world_size_unless_the_order_names_new_ones():
    p = Placement(node_rank=0, nproc_per_node=2, standby=False)
    p.start(m.StartRanks(attempt=0, store_host="h", store_port=5, world_size=2, store_prefix="k1"))
    p.restart(m.RestartRank(rank=1, attempt=0, gen=1))
    assert (p.store_addr, p.store_prefix, p.world_size) == (("h", 5), "k1", 2)
    p.restart(m.RestartRank(rank=1, attempt=0, gen=2, store_host="g", store_port=6, world_size=2,
                              store_prefix="k2"))
    assert (p.store_addr, p.store_prefix) == (("g", 6), "k2")


def test_a_standby_numbers_moved_ranks_in_arrival_order_and_keeps_them():
    p = Placement(node_rank=0, nproc_per_node=4, standby=True)
    p.restart(m.RestartRank(rank=6, attempt=0, gen=1, store_host="h", store_port=5, world_size=8))
    assert [p.local_rank(6), p.local_rank(2), p.local_rank(6)] == [0, 1, 0]
    assert p.world_size == 8


def test_a_scale_out_order_restores_survivors_under_their_shrunk_numbers_and_fetches_for_the_rest():
    """controller/elastic.py's grow: the launch's shape (no data-rank environment), each surviving rank
    restoring its shrunk number's snapshot, the ranks taken in fetching a survivor's first."""
    from unbroken.worker_config import ENV_DATA_RANKS, ENV_RESTORE_RANK

    p = Placement(node_rank=1, nproc_per_node=2, standby=False)
    msg = m.StartRanks(attempt=2, store_host="h", store_port=5, world_size=6, ranks=[2, 3], local_ranks=[0, 1],
                       restore_ranks=[-1, 1], fetch_agents=[0, -1], fetch_ranks=[0, -1])
    ranks = p.start(msg)
    assert ranks == [2, 3] and [p.local_rank(r) for r in ranks] == [0, 1]
    assert p.shape_env(2) == {} and p.shape_env(3) == {ENV_RESTORE_RANK: "1"}
    assert ENV_DATA_RANKS not in p.shape_env(3)
    assert p.fetch_sources(msg, ranks) == {2: (0, 0)}
