"""An agent's bookkeeping of the ranks it runs: which ranks, their local ranks, and the
attempt's store, its key prefix and world size, as the controller's orders say. Pure: no processes.

Owned by one :class:`~unbroken.agent.agent.Agent`, used from its command thread. A node's
agent runs its own ranks (local rank = rank - node_rank * nproc_per_node); a standby agent
runs whatever ranks were moved to it (rung `recover`), numbered 0, 1, ... in the order they
came, a rank keeping its local rank when it is restarted there again.
"""

from __future__ import annotations

from unbroken.protocol import messages as m


class Placement:
    """The ranks of one agent and where their attempt's store is (see the module docstring)."""

    def __init__(self, node_rank: int, nproc_per_node: int, standby: bool) -> None:
        self._node_rank, self._nproc, self._standby = node_rank, nproc_per_node, standby
        self.store_addr: tuple[str, int] = ("", 0)
        self.store_prefix = ""  # every rendezvous key of the attempt lives under it (controller/rendezvous.py)
        self.world_size = 0  # the job's, from the controller's orders
        self._moved: dict[int, int] = {}  # rank -> local rank, on a standby agent

    def own_ranks(self) -> list[int]:
        return [self._node_rank * self._nproc + i for i in range(self._nproc)]

    def start(self, msg: m.StartRanks) -> list[int]:
        """A new attempt: its store, key prefix and world size; the ranks to start (this node's own
        by default)."""
        self.store_addr, self.store_prefix = (msg.store_host, msg.store_port), msg.store_prefix
        self.world_size = msg.world_size
        return list(msg.ranks) or self.own_ranks()

    def restart(self, msg: m.RestartRank) -> None:
        """One rank restarted in flight: a store (with its key prefix) or world size in the order
        replaces ours."""
        if msg.store_port:
            self.store_addr, self.store_prefix = (msg.store_host, msg.store_port), msg.store_prefix
        self.world_size = msg.world_size or self.world_size

    def local_rank(self, rank: int) -> int:
        if self._standby:
            return self._moved.setdefault(rank, len(self._moved))
        return rank - self._node_rank * self._nproc
