"""The generations of one job's process groups inside one process.

A :class:`Fabric` owns every :class:`~unbroken.parallel.group.SurvivingGroup` of the job in
this process (the world group and every sub-group torch creates on it: ``new_group``,
``DeviceMesh`` dimensions), the job's :class:`~unbroken.parallel.group.AbortSignal` and the
graveyard of abandoned backends and works. :meth:`Fabric.switch` moves every group, in
creation order (the same on every rank), to generation ``g``'s gloo groups on the store
prefix ``gen<g>/<group key>/``; the group objects the wrappers hold stay the same.

torch is told about our groups through a backend plugin registered under a name unique to
this fabric (``Backend.register_backend``; torch's plugin table is process-wide, so two jobs
in one process get two names and share nothing). ``init_world()`` makes the default group
ours, so ``dist.new_group`` and ``init_device_mesh`` build SurvivingGroups too, and torch's
own bookkeeping (group names, global-rank maps, the functional-collective registry) is filled
by torch itself.

torch 2.14+ has an in-place reconfigure of a real group (``init_process_group(...,
enable_reconfigure=True)``, ``dist._reconfigure``): :func:`reconfigure_available` reports
whether the installed torch has it. This module does not use it yet (2.13 has no such API and
it cannot be tested here); where it exists, a generation switch could reconfigure each
backend in place instead of building a new one, keeping everything above unchanged.

Runs in the training thread of one rank (``switch`` included: it is a collective of the
whole job); the abort signal may be fired from any thread.
"""

from __future__ import annotations

import ctypes
import inspect
import time
import uuid
from datetime import timedelta
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from unbroken.comm.groups import gloo_group
from unbroken.errors import ConfigError
from unbroken.parallel.ddp import DdpRegistry
from unbroken.parallel.group import AbortSignal, SurvivingGroup

WORLD_PREFIX = "unbroken-world/"
#: Collectives after which every member holds the same result (on the world group: every rank).
_REPLICATING_OPS = frozenset({"allreduce", "allreduce_coalesced", "broadcast", "barrier", "allgather",
                              "_allgather_base", "allgather_coalesced"})


def reconfigure_available() -> bool:
    """True where the installed torch has the experimental in-place group reconfigure (2.14+)."""
    init_params = inspect.signature(dist.init_process_group).parameters
    return hasattr(dist, "_reconfigure") and "enable_reconfigure" in init_params


class Fabric:
    """Every SurvivingGroup of one job in this process, and the generation they are on.

    Not thread-safe except :attr:`signal`: build, switch and close from the training thread.
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, *, timeout_s: float = 30.0,
                 name: str | None = None, graveyard: list[Any] | None = None, lazy_connect: bool = False) -> None:
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside the world of {world_size} ranks (allowed: 0..{world_size - 1})")
        if timeout_s <= 0:
            raise ConfigError(f"timeout_s={timeout_s} must be > 0 (it bounds how long an abandoned op holds memory)")
        self._store, self.rank, self.world_size = store, rank, world_size
        self.timeout = timedelta(seconds=timeout_s)
        self.lazy_connect = lazy_connect  # each generation's backends connect a pair on first use (comm/groups.py)
        self.signal = AbortSignal()
        self.graveyard: list[Any] = [] if graveyard is None else graveyard  # the owner's list, if given
        self.groups: list[SurvivingGroup] = []
        self.ddps = DdpRegistry()  # every DDP built on one of the groups, in construction order
        self.before_reduce: Callable[[], None] | None = None  # called before each reduction is issued
        self.on_collective: Callable[[Any], None] | None = None  # given each other collective's work once issued
        #: The first op issued that may leave ranks holding different state (a send or recv, an all-to-all, a
        #: reduce-scatter, a reduction to one rank, any op on a sub-group), e.g. "send on group 'g1'"; None:
        #: none yet. Where none is ever seen, a step's update made on one rank is every rank's (worker/commit.py).
        self.partial_op: str | None = None
        self._gen = -1
        self._prepared: tuple[int, list[Any]] | None = None  # (generation, backends built ahead: prepare())
        self._held = False
        self.backend_name = f"unbroken_{name or uuid.uuid4().hex[:12]}"
        dist.Backend.register_backend(self.backend_name, self._create, extended_api=True, devices=["cpu"])

    @property
    def generation(self) -> int:
        """The generation every group is on; -1 before the first :meth:`switch` (detached)."""
        return self._gen

    def init_world(self) -> SurvivingGroup:
        """Make the default process group a SurvivingGroup (detached until :meth:`switch`)."""
        dist.init_process_group(backend=self.backend_name, store=dist.PrefixStore(WORLD_PREFIX, self._store),
                                rank=self.rank, world_size=self.world_size, timeout=self.timeout)
        world = dist.group.WORLD
        assert isinstance(world, SurvivingGroup), world
        return world

    def _create(self, opts: Any, _backend_options: Any) -> SurvivingGroup:
        """torch's plugin hook: a new group of ``opts.group_size`` ranks (``new_group``, a mesh dim)."""
        ranks = list(opts.global_ranks_in_group) or list(range(opts.group_size))
        group = SurvivingGroup(opts.group_rank, opts.group_size, ranks, f"g{opts.group_id}",
                               self.signal, self.graveyard, before_reduce=self._reducing, ddps=self.ddps,
                               on_collective=self._collective)
        group.held = self._held
        group.on_op = self._note_op
        self.groups.append(group)
        if self._gen >= 0:  # created after the job joined a generation: every member builds it now
            group._attach(self._gen, self._backend_for(group, self._gen))
        return group

    def _reducing(self) -> None:
        if self.before_reduce is not None:
            self.before_reduce()

    def _note_op(self, group: SurvivingGroup, op: str) -> None:
        if self.partial_op is None and (op not in _REPLICATING_OPS or group is not self.groups[0]):
            self.partial_op = f"{op} on group {group.key!r}"

    def _collective(self, work: Any) -> None:
        if self.on_collective is not None:
            self.on_collective(work)

    @property
    def world(self) -> SurvivingGroup:
        """The default group (built by :meth:`init_world`)."""
        return self.groups[0]

    def hold(self) -> None:
        """Make every group's collectives complete locally until :meth:`release` (see SurvivingGroup)."""
        self._held = True
        for group in self.groups:
            group.held = True

    def release(self) -> None:
        """Collectives go to the current generation's backends again."""
        self._held = False
        for group in self.groups:
            group.held = False

    def _backend_for(self, group: SurvivingGroup, gen: int) -> Any:  # a ProcessGroupGloo (a Backend)
        store = dist.PrefixStore(f"gen{gen}/{group.key}/", self._store)
        return gloo_group(store, group.rank(), group.size(), self.timeout, lazy_connect=self.lazy_connect)

    def prepare(self, gen: int) -> None:
        """Build generation ``gen``'s backends ahead of :meth:`switch`, e.g. while this rank waits
        for the regroup order. Only with lazy connections, whose build waits for no peer (it
        publishes this rank's address); a full mesh connects every pair at the build. Backends
        prepared for a generation the job does not switch to go to the graveyard."""
        if not self.lazy_connect or gen <= self._gen or (self._prepared and self._prepared[0] == gen):
            return
        self._drop_prepared()
        self._prepared = (gen, [self._backend_for(group, gen) for group in self.groups])

    def _drop_prepared(self) -> None:
        if self._prepared is not None:
            self.graveyard.extend(self._prepared[1])  # never destroyed early: see FACTS.md
            self._prepared = None

    def switch(self, gen: int) -> float:
        """Move every group to generation ``gen`` (a collective of every rank of the job).

        Blocks until every member of each group has connected (gloo builds its mesh), at most
        the fabric's timeout; backends built by :meth:`prepare` for ``gen`` are used as they are.
        Clears the abort signal once the new backends are in place. Returns the seconds it took.
        """
        if gen <= self._gen:
            raise ConfigError(f"generation {gen} is not newer than the current one ({self._gen}): "
                              "each generation's store prefix may be used once")
        started = time.monotonic()
        ready = self._prepared[1] if self._prepared and self._prepared[0] == gen else []
        if not ready:
            self._drop_prepared()
        self._prepared = None
        for n, group in enumerate(self.groups):  # (a group created since prepare() is built now)
            group._attach(gen, ready[n] if n < len(ready) else self._backend_for(group, gen))
        self._gen = gen
        self.signal.clear()
        return time.monotonic() - started

    def prune_graveyard(self) -> int:
        """Drop abandoned works that have ended; returns how many are still pending: torch works, and
        anything else that says whether it ended (``is_completed``), e.g. a state exchange's thread
        (comm/p2p.py), which may still be inside a call on an old backend (a send to a lost peer on a
        lazily connected pair waits there for the connection). The backends themselves are kept: one
        may be dropped only once nothing runs on it (FACTS.md)."""
        self.graveyard[:] = [w for w in self.graveyard if not _is_work(w) or not w.is_completed()]
        return sum(1 for w in self.graveyard if _is_work(w))

    def release_graveyard(self, timeout_s: float) -> bool:
        """At the job's end: wait up to ``timeout_s`` for the abandoned operations to end, then empty
        the graveyard; True if nothing was still pending.

        An operation still pending (a survivor's all-reduce with a peer that left the step before it,
        which nothing fails in a dp group the lost rank is not in) aborts the process at exit once its
        peer exits (``terminate`` on gloo's IoException), so it is waited for: it ends when its peers
        close their old backends or at its timeout. What cannot be destroyed safely is kept to the
        process's end instead, past the interpreter's finalization (a deliberate leak the exit frees):
        the entries still pending at the deadline (destroying a backend a state exchange's thread is
        still inside blocks: gloo's loop shutdown joins while a send waits for its pair's first
        connection, which gloo allows 5 x the timeout), and every old backend of a lazily connected
        fabric (seen hanging there under load with nothing pending; py-spy, NOTES 2026-12-06)."""
        deadline = time.monotonic() + timeout_s
        while (pending := self.prune_graveyard()) and time.monotonic() <= deadline:
            time.sleep(0.01)
        if pending or self.lazy_connect:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(list(self.graveyard)))
        if pending:
            return False
        self.graveyard.clear()
        return True

    def close(self) -> None:
        """Tear the default group down and drop every group's backend; abandoned backends stay in
        the graveyard. Only with no collective pending on a current backend (FACTS.md: dropping
        such a group blocks until its timeout)."""
        for group in self.groups:
            group._backend = None
        if dist.is_initialized():
            dist.destroy_process_group()


def _is_work(obj: Any) -> bool:
    """Whether a graveyard entry is an operation (it ends) rather than a backend (kept until none runs)."""
    return isinstance(obj, dist.Work) or callable(getattr(obj, "is_completed", None))
