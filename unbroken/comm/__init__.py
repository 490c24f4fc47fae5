"""Collectives that can be abandoned: the machinery under optim/, recovery/ and worker/.

* :func:`~unbroken.comm.wait.wait_all` -- wait on async collectives, leave on an abort order;
* :func:`~unbroken.comm.p2p.exchange_states` -- each piece of state from one live holder to the
  ranks that need it, no pickle;
* :func:`~unbroken.comm.groups.generation_group` -- the process group of one generation;
* :mod:`~unbroken.comm.movers` -- after a regroup, the transfer's movers first, the other survivors after.

Imports only torch, :mod:`unbroken.errors` and :mod:`unbroken.state` (how state becomes bytes):
never the checkpoint engine (scripts/import_graph.py holds it to that).
"""

from unbroken.comm.groups import generation_group
from unbroken.comm.wait import AbortCheck, wait_all

__all__ = ["AbortCheck", "generation_group", "wait_all"]
