"""An agent's bookkeeping of the ranks it runs: which ranks, their local ranks, and the
attempt's store, its key prefix and world size, as the controller's orders say. Pure: no processes.

Owned by one :class:`~unbroken.agent.agent.Agent`, used from its command thread. A node's
agent runs its own ranks (local rank = rank - node_rank * nproc_per_node); a standby agent
runs whatever ranks were moved to it (rung `recover`), numbered 0, 1, ... in the order they
came, a rank keeping its local rank when it is restarted there again.
"""

from __future__ import annotations

from unbroken.protocol import messages as m
from unbroken.worker_config import ENV_DATA_RANKS, ENV_DATA_WORLD_SIZE, ENV_LR_SCALE, ENV_RESTORE_RANK


class Placement:
    """The ranks of one agent and where their attempt's store is (see the module docstring)."""

    def __init__(self, node_rank: int, nproc_per_node: int, standby: bool) -> None:
        self._node_rank, self._nproc, self._standby = node_rank, nproc_per_node, standby
        self.store_addr: tuple[str, int] = ("", 0)
        self.store_prefix = ""  # every rendezvous key of the attempt lives under it (controller/rendezvous.py)
        self.world_size = 0  # the job's, from the controller's orders
        self._moved: dict[int, int] = {}  # rank -> local rank, on a standby agent
        self._local: dict[int, int] = {}  # rank -> local rank, once rung elastic renumbered the ranks
        self._shape: dict[int, dict[str, str]] = {}  # rank -> its elastic environment (controller/elastic.py)

    def own_ranks(self) -> list[int]:
        return [self._node_rank * self._nproc + i for i in range(self._nproc)]

    def start(self, msg: m.StartRanks) -> list[int]:
        """A new attempt: its store, key prefix and world size; the ranks to start (this node's own
        by default)."""
        self.store_addr, self.store_prefix = (msg.store_host, msg.store_port), msg.store_prefix
        self.world_size = msg.world_size
        ranks = list(msg.ranks) or self.own_ranks()
        self._local = dict(zip(ranks, msg.local_ranks)) if msg.local_ranks else {}
        self._shape = {}
        # The job shrank (rung elastic) or grew back: each rank's data ranks, and whose snapshot it restores.
        if msg.data_ranks or msg.restore_ranks:
            data = msg.data_ranks or [""] * len(ranks)
            restore = msg.restore_ranks or [-1] * len(ranks)
            for rank, shard, old in zip(ranks, data, restore):
                self._shape[rank] = _shape_env(shard, msg.data_world_size, msg.lr_scale, old)
        return ranks

    @staticmethod
    def fetch_sources(msg: m.StartRanks, ranks: list[int]) -> dict[int, tuple[int, int]]:
        """After a scale-out: rank -> (agent, rank) whose snapshot this agent fetches for it first."""
        return {rank: (agent, source) for rank, agent, source in zip(ranks, msg.fetch_agents, msg.fetch_ranks)
                if agent >= 0 and source >= 0}

    def restart(self, msg: m.RestartRank) -> None:
        """One rank restarted in flight: a store (with its key prefix) or world size in the order
        replaces ours."""
        if msg.store_port:
            self.store_addr, self.store_prefix = (msg.store_host, msg.store_port), msg.store_prefix
        self.world_size = msg.world_size or self.world_size
        if msg.data_ranks:  # a replacement runs the data ranks of the rank it replaces; no snapshot to restore
            self._shape[msg.rank] = _shape_env(msg.data_ranks, msg.data_world_size, msg.lr_scale, -1)
        else:
            self._shape.pop(msg.rank, None)

    def shape_env(self, rank: int) -> dict[str, str]:
        """The environment of ``rank``'s share of a shrunk job (none before the job shrank)."""
        return self._shape.get(rank, {})

    def local_rank(self, rank: int) -> int:
        if rank in self._local:
            return self._local[rank]
        if self._standby:
            return self._moved.setdefault(rank, len(self._moved))
        return rank - self._node_rank * self._nproc


def _shape_env(data_ranks: str, data_world_size: int, lr_scale: float, restore_rank: int) -> dict[str, str]:
    env = {ENV_DATA_RANKS: data_ranks, ENV_DATA_WORLD_SIZE: str(data_world_size), ENV_LR_SCALE: repr(lr_scale)} \
        if data_ranks else {}  # (a scale-out: the launch's shape, one data rank each)
    if restore_rank >= 0:
        env[ENV_RESTORE_RANK] = str(restore_rank)
    return env
