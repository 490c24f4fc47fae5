"""The worker's nouns: the contract of training state that recovers itself in flight.

Most tracked objects (a module, a torch optimizer, a scheduler, a sampler) are *plain*:
every data-parallel rank holds the same copy, so after a loss the session sends the lowest
survivor's ``state_dict()`` to the replaced ranks. Some state is laid out across ranks and
must be rebuilt from the ranks that hold each piece: today :class:`unbroken.optim.ShardedOptimizer`
(optimizer shards with ``num_replicas`` holders each); next, DDP/FSDP2/TP/PP adapters whose
pieces are found through a replica map over the job's mesh. Such an object implements
:class:`RecoverableState`; the session (:mod:`unbroken.worker.session`) and in-flight
recovery (:mod:`unbroken.worker.inflight`) talk to it only through these methods.

The life of a recoverable object, all in the training thread of its rank::

    attach(hooks)            at job.track(): phase reports, abort check, deferred completion
    step ...                 reports "sync"/"update"/"done" through hooks.on_phase; every
                             collective polls hooks.should_abort and leaves on an abort order,
                             its pending work kept in ``abandoned_work``
    -- a fault --
    step_pending             True when a committed step's completion (e.g. the parameter
                             gather) was cut: the session recovers before the next step
    set_process_group(g)     the next generation's group (same size, same rank)
    recover(replaced)        collective on g, every rank in the same order: pieces of the
                             replaced ranks come from live holders; a cut completion finishes
                             (``recover(())`` with nobody replaced only completes it)
    release_process_groups() the job is over: drop group references (never with abandoned work)

Implement it by subclassing (``class MyAdapter(RecoverableState)``) or by
``RecoverableState.register(MyAdapter)`` for a class with the same methods.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

#: ``on_phase(phase, step)``: a recoverable object reports the phases of its step.
PhaseCallback = Callable[[str, int], None]
#: ``should_abort()``: True once the controller ordered this generation's collectives abandoned.
AbortCheck = Callable[[], bool]


@dataclass(frozen=True)
class SessionHooks:
    """What a session gives a recoverable object it tracks (see :meth:`RecoverableState.attach`).

    ``defer_completion``: under `unbroken run`, a step that committed but whose completion
    (the parameter gather) was cut must not raise; the object marks ``step_pending`` and the
    session completes it during the regroup.

    ``fail``: called with a :class:`~unbroken.errors.FatalError` the object is about to raise from
    the script's own code, outside the session's calls: under `unbroken run` it ends the process
    with EXIT_FATAL (the job fails at once, not restarted); elsewhere it returns.
    """

    on_phase: PhaseCallback
    should_abort: AbortCheck
    defer_completion: bool
    fail: Callable[[Exception], None] = lambda exc: None


class RecoverableState(abc.ABC):
    """Training state laid out across ranks that rebuilds itself from live holders."""

    @property
    @abc.abstractmethod
    def num_replicas(self) -> int:
        """Copies of each piece across the data-parallel ranks (1: no replica, pieces are lost with
        their rank; the world size: full replication)."""

    @abc.abstractmethod
    def attach(self, hooks: SessionHooks) -> None:
        """Take the session's hooks; a hook the user passed at construction stays."""

    @property
    @abc.abstractmethod
    def step_pending(self) -> bool:
        """True when the last step committed but its completion was cut by a fault."""

    @property
    @abc.abstractmethod
    def abandoned_work(self) -> list[Any]:
        """Collective work left on an abort, kept referenced until it ends (FACTS.md)."""

    @abc.abstractmethod
    def set_process_group(self, process_group: dist.ProcessGroup) -> None:
        """Use the next generation's group from now on (same size, same rank)."""

    @abc.abstractmethod
    def recover(self, replaced: Iterable[int]) -> None:
        """Collective on the current group: rebuild the pieces of ``replaced`` from live holders
        (NoLiveReplica if a piece has none) and complete a cut step (``step_pending``)."""

    @abc.abstractmethod
    def release_process_groups(self) -> None:
        """Drop every reference to a process group (the job is over)."""


def recoverable(objects: Iterable[Any]) -> list[RecoverableState]:
    """The objects among ``objects`` that implement :class:`RecoverableState`."""
    return [o for o in objects if isinstance(o, RecoverableState)]
