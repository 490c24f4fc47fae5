"""Collectives that can be abandoned: the machinery under optim/, recovery/ and worker/.

* :func:`~unbroken.comm.wait.wait_all` -- wait on async collectives, leave on an abort order;
* :func:`~unbroken.comm.transfer.broadcast_state` -- send a state tree from one rank, no pickle;
* :func:`~unbroken.comm.groups.generation_group` -- the process group of one generation;
* :mod:`~unbroken.comm.movers` -- after a regroup, the transfer's movers first, the other survivors after.

Imports only torch, :mod:`unbroken.errors` and the checkpoint codec (pure).
"""

from unbroken.comm.groups import generation_group
from unbroken.comm.transfer import broadcast_state
from unbroken.comm.wait import AbortCheck, wait_all

__all__ = ["AbortCheck", "broadcast_state", "generation_group", "wait_all"]
