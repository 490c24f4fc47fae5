"""Replicated ZeRO-1 optimizer and the replica map (DESIGN.md section 5).

* :class:`ShardedOptimizer` -- wraps any elementwise torch optimizer; optimizer state is
  sharded over ``d / num_replicas`` ranks and every shard is held by ``num_replicas`` ranks.
* :class:`ReplicaMap`, :class:`Piece` -- which ranks hold an identical copy of each piece
  of training state; pure, for recovery planning. They live in :mod:`unbroken.recovery.replica_map`
  (recovery policy must not import the optimizer) and are re-exported here.
"""

from unbroken.optim.sharded import ShardedOptimizer
from unbroken.recovery.replica_map import Piece, ReplicaMap

__all__ = ["Piece", "ReplicaMap", "ShardedOptimizer"]
