"""A tracked torchdata ``StatefulDataLoader``: its live iterator follows its state, its sampler's epoch is state.

The usual loop makes its iterator once (``it = iter(loader)`` before ``job.steps()``) and a new
one at each epoch rollover (``it = iter(loader)`` after ``StopIteration``). torchdata's
``StatefulDataLoader.load_state_dict`` only affects the *next* ``iter(loader)``: the iterator
the script holds keeps its old position, so a state unbroken loads (a survivor's rollback of a
dropped step, a replacement's own state, a restart's checkpoint) would be silently ignored by
the data. And a ``DistributedSampler`` keeps its epoch outside every ``state_dict``. So, for a
tracked ``StatefulDataLoader`` (and nothing else):

* **state** (:func:`state_of`) is ``loader.state_dict()`` plus the epoch of the sampler inside
  it (``loader.sampler``, or ``loader.batch_sampler.sampler``, when it has ``set_epoch``), under
  the key :data:`EPOCH_KEY` (``loader.load_state_dict`` ignores it: a checkpoint stays loadable
  by hand);
* **loading** (:func:`load`) sets the sampler's epoch first (the loader's sampler iterator is
  rebuilt from it), then repositions the *live* iterator, the one the last ``iter(loader)``
  returned (``loader._iterator``), in place: the object the script holds is re-initialised
  from the state (its worker processes, if any, are shut down and started again), so the next
  ``next(it)`` yields what the saved run's next ``next(it)`` yielded. Without a live iterator
  it is ``loader.load_state_dict``.
* **the epoch moves with the passes**: ``iter(loader)`` that starts a new pass after the last
  one ended (its iterator, or the state loaded into the loader, is finished) first moves the
  sampler to the next epoch, so every pass reshuffles as ``set_epoch`` would, and the epoch
  is always the one the restored state implies.
* **the script does not set the epoch**: ``sampler.set_epoch(e)`` on a tracked loader's sampler
  raises a :class:`~unbroken.errors.ConfigError` at its first call (in the usual script,
  before the first step). An ``e`` counted in a script variable is not training state: after
  a rollback or in a replacement it would disagree with the restored epoch, and the data order
  would silently differ from the fault-free run. No value can tell such a counter from a
  correct one until a fault, so every call is refused, the same way in every run.
* **the workers' random streams** (``num_workers > 0``) are the workers' state, carried in their
  snapshots (:mod:`unbroken.worker.loader_streams`); also for a loader the script's own tracked
  data object holds (:func:`watch_held`).

Private torchdata / torch APIs used (torchdata 0.11, torch 2.13): ``StatefulDataLoader._iterator``
(the live iterator) and ``next_iter_state`` (a state loaded without one), the iterators'
``__init__(loader, next_iter_state)``, ``_finished``, the state key ``_iterator_finished`` and a
multi-process iterator's ``_shutdown_workers()``.

Runs in the training thread of one rank, called by :class:`~unbroken.worker.tracked.TrackedState`.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import Any

from unbroken.errors import ConfigError
from unbroken.worker import loader_streams

log = logging.getLogger(__name__)

#: The key of the sampler's epoch in a tracked loader's state.
EPOCH_KEY = "unbroken_sampler_epoch"
#: torchdata's key, in an iterator's state, of whether its pass ended.
_FINISHED_KEY = "_iterator_finished"


def _loader_class() -> type | None:
    """torchdata's StatefulDataLoader, if the script imported it (a script using one has)."""
    module = sys.modules.get("torchdata.stateful_dataloader.stateful_dataloader")
    return getattr(module, "StatefulDataLoader", None)


def is_loader(obj: Any) -> bool:
    cls = _loader_class()
    return cls is not None and isinstance(obj, cls)


def epoch_sampler(loader: Any) -> Any | None:
    """The sampler inside ``loader`` that has an epoch (``set_epoch`` and ``epoch``: a DistributedSampler)."""
    for sampler in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if sampler is not None and callable(getattr(sampler, "set_epoch", None)) and hasattr(sampler, "epoch"):
            return sampler
    return None


def watch(loader: Any, fail: Callable[[Exception], None]) -> None:
    """At ``job.track``: the loader starts each new pass at the next epoch, and its sampler refuses
    ``set_epoch`` (``fail``, the session's :attr:`~unbroken.worker.api.SessionHooks.fail`, first)."""
    refuse_unresumable_sampler(loader, "a StatefulDataLoader given to job.track")
    if getattr(loader, "num_workers", 0) > 0:
        loader_streams.wrap(loader)  # the workers' random streams are their state
        if getattr(loader, "_iterator", None) is not None:
            log.warning("a StatefulDataLoader given to job.track after `iter(loader)` started its %d worker "
                        "processes: those workers do not keep their random streams, so a rank resuming in this "
                        "pass may draw other augmentations than the fault-free run; track it before iter(loader)",
                        loader.num_workers)
    sampler = epoch_sampler(loader)
    if sampler is None or isinstance(sampler.__dict__.get("set_epoch"), _RefuseSetEpoch):
        return
    sampler.set_epoch = _RefuseSetEpoch(getattr(sampler, "rank", "?"), fail)
    loader.__class__ = _epoch_advancing(type(loader))


def watch_held(obj: Any) -> None:
    """At ``job.track`` of an object that is not a loader: a loader it holds in an attribute (a script's
    data wrapper whose ``state_dict`` holds ``loader.state_dict()``) keeps its workers' random streams
    too (:mod:`unbroken.worker.loader_streams`); its position and epoch stay the wrapper's business."""
    for name, value in getattr(obj, "__dict__", {}).items():
        if is_loader(value):
            refuse_unresumable_sampler(value, f"the StatefulDataLoader in .{name} of a {type(obj).__name__} "
                                              f"given to job.track")
            if getattr(value, "num_workers", 0) > 0:
                loader_streams.wrap(value)
            if not getattr(type(value), "_unbroken_load_follows", False):
                value.__class__ = _load_following(type(value))


def iterators_of(obj: Any) -> list[Any]:
    """The live iterator of ``obj`` if it is a loader, else those of the loaders it holds in attributes,
    and the loader iterators it holds itself (a data wrapper's ``self.it``): their state is tracked."""
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    if is_loader(obj):
        return [it] if (it := getattr(obj, "_iterator", None)) is not None else []
    held = getattr(obj, "__dict__", {}).values()
    return [x for v in held if is_loader(v) for x in iterators_of(v)] + [
        v for v in held if isinstance(v, _BaseDataLoaderIter)]


def refuse_unresumable_sampler(loader: Any, what: str) -> None:
    """ConfigError if ``loader`` samples with one of torch's random samplers: each ``iter()`` of one
    draws a new order (from its generator, or the global stream), and torchdata resumes a sampler
    without state by iterating it again, so a rank resuming mid-epoch would read other samples."""
    from torch.utils.data import RandomSampler, SubsetRandomSampler, WeightedRandomSampler

    batch_sampler = getattr(loader, "batch_sampler", None)
    for sampler in (getattr(loader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None)):
        if isinstance(sampler, (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)) and not (
                callable(getattr(sampler, "state_dict", None)) and callable(getattr(sampler, "load_state_dict", None))):
            raise ConfigError(
                f"{what} samples with torch's {type(sampler).__name__}, which draws a new order at each iter() and "
                "keeps no state: torchdata resumes it by iterating it again, so after a fault a rank would read "
                "other samples than the fault-free run (exit 0, other weights). Use shuffle=True (torchdata's "
                "stateful RandomSampler; generator= as you like), a DistributedSampler, or a sampler with "
                "state_dict/load_state_dict")


def state_of(loader: Any) -> dict[str, Any]:
    """``loader.state_dict()`` with the epoch of its sampler (see the module docstring)."""
    state = loader.state_dict()
    sampler = epoch_sampler(loader)
    return {**state, EPOCH_KEY: int(sampler.epoch)} if sampler is not None else state


def load(loader: Any, state: dict[str, Any]) -> None:
    """Load a :func:`state_of` into ``loader``: its sampler's epoch, then its live iterator, in place."""
    state = dict(state)
    epoch = state.pop(EPOCH_KEY, None)
    sampler = epoch_sampler(loader)
    if epoch is not None and sampler is not None:
        _set_epoch(sampler, int(epoch))
    live = getattr(loader, "_iterator", None)
    if live is None or not state:
        loader.load_state_dict(state)
        return
    _reposition(live, loader, state)  # the iterator the script holds, now at the state's position


def _reposition(live: Any, loader: Any, state: dict[str, Any]) -> None:
    """Re-initialise the iterator ``live`` of ``loader`` in place at ``state``. A multi-process one's
    workers prefetched from the old position: shut down first. Making an iterator draws its base seed
    from torch's stream (or the loader's generator), which the state then replaces and the fault-free
    run never drew: both are put back."""
    import torch

    shutdown = getattr(live, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
    generator = getattr(loader, "generator", None)
    saved = torch.get_rng_state(), generator.get_state() if generator is not None else None
    try:
        type(live).__init__(live, loader, state)
    finally:
        torch.set_rng_state(saved[0])
        if generator is not None:
            generator.set_state(saved[1])


def _set_epoch(sampler: Any, epoch: int) -> None:
    type(sampler).set_epoch(sampler, epoch)  # the class's own method, under the instance's refusal


def _starts_next_pass(loader: Any) -> bool:
    """Whether ``iter(loader)`` now starts a new pass after one that ended (see the module docstring)."""
    live = getattr(loader, "_iterator", None)
    if live is not None:
        return bool(getattr(live, "_finished", False))
    pending = getattr(loader, "next_iter_state", None)  # a state loaded while no iterator was live
    return isinstance(pending, dict) and bool(pending.get(_FINISHED_KEY, False))


@functools.cache
def _epoch_advancing(cls: type) -> type:
    """``cls`` whose ``iter()`` moves the sampler to the next epoch before a new pass (one class per loader class)."""

    def __iter__(self):  # noqa: N807 (the protocol's name)
        if _starts_next_pass(self):
            sampler = epoch_sampler(self)
            _set_epoch(sampler, int(sampler.epoch) + 1)
        return super(advancing, self).__iter__()

    advancing = type(cls.__name__, (cls,), {"__iter__": __iter__, "__module__": cls.__module__,
                                            "__qualname__": cls.__qualname__})
    return advancing


@functools.cache
def _load_following(cls: type) -> type:
    """``cls`` whose ``load_state_dict`` also moves the live iterator (for a loader a tracked object holds).

    torchdata's ``load_state_dict`` only affects the next ``iter(loader)``; a wrapper that keeps the
    iterator it made (``self.it``) across its own ``load_state_dict`` was right for a load before the
    first batch, but unbroken loads mid-run (a survivor's rollback): its iterator would go on from the
    old position. So the live iterator takes the state too, at its next ``next()`` (the wrapper may set
    the sampler's epoch after loading), unless ``iter(loader)`` is called first (a wrapper that makes a
    new iterator: torchdata's own way)."""

    def load_state_dict(self, state):
        live = getattr(self, "_iterator", None)
        super(following, self).load_state_dict(state)
        if live is not None and state:
            live.__class__ = _repositioning(type(live))
            live._unbroken_pending = (self, state)

    following = type(cls.__name__, (cls,), {"load_state_dict": load_state_dict, "_unbroken_load_follows": True,
                                            "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    return following


@functools.cache
def _repositioning(cls: type) -> type:
    """A loader iterator class that takes a state loaded into its loader at its next ``next()``."""

    def __next__(self):  # noqa: N807 (the protocol's name)
        pending = self.__dict__.pop("_unbroken_pending", None)
        if pending is not None:
            loader, state = pending
            made = getattr(loader, "_iterator", None)  # by loader.state_dict() since the load (unbroken's reads)
            by_read = made is not None and made is not self and getattr(loader, "_initial_iter_for_state_dict", False)
            if getattr(loader, "next_iter_state", None) is state or by_read:  # no iter(loader) took the state
                shutdown = getattr(made, "_shutdown_workers", None) if by_read else None
                if shutdown is not None:  # the one the read made goes unused
                    shutdown()
                _reposition(self, loader, state)
                loader._iterator, loader.next_iter_state, loader._initial_iter_for_state_dict = self, None, False
        return super(repositioning, self).__next__()

    repositioning = type(cls.__name__, (cls,), {"__next__": __next__, "__module__": cls.__module__,
                                                "__qualname__": cls.__qualname__})
    return repositioning


class _RefuseSetEpoch:
    """The ``set_epoch`` of a tracked loader's sampler (an instance attribute over the class's method)."""

    def __init__(self, rank: Any, fail: Callable[[Exception], None]) -> None:
        self._rank, self._fail = rank, fail

    def __call__(self, epoch: int) -> None:
        error = ConfigError(
            f"rank {self._rank}: sampler.set_epoch({epoch}) on the sampler of a loader given to job.track: "
            "unbroken keeps that sampler's epoch as training state and moves it to the next epoch itself "
            "whenever `iter(loader)` starts a new pass after the last one ended. An epoch set by the script "
            "comes from a counter that is not restored after a fault, so the data order would silently "
            "differ from the fault-free run. Remove the set_epoch calls (keep `it = iter(loader)` at each "
            "rollover); read the epoch as `sampler.epoch`")
        self._fail(error)  # under `unbroken run`: EXIT_FATAL here
        raise error
