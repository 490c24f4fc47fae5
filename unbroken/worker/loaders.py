"""A tracked torchdata ``StatefulDataLoader``: its live iterator follows its state, its sampler's epoch is state.

The usual loop makes its iterator once (``it = iter(loader)`` before ``job.steps()``) and a new
one at each epoch rollover (``sampler.set_epoch(e); it = iter(loader)``). torchdata's
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
* the script's **epoch counter** is the script's, not state: a ``set_epoch(e)`` from a counter
  unbroken did not restore would silently reshuffle differently from the fault-free run.
  :class:`EpochGuard` checks the first ``set_epoch`` after each load: at a rollover (the live
  iterator is exhausted) it must move to the loaded epoch + 1, elsewhere keep it or move to the
  next; any other value raises a :class:`~unbroken.errors.ConfigError` that says what to write.

Private torchdata / torch APIs used (torchdata 0.11, torch 2.13): ``StatefulDataLoader._iterator``
(the live iterator), the iterators' ``__init__(loader, next_iter_state)``, ``_finished`` and a
multi-process iterator's ``_shutdown_workers()``.

Runs in the training thread of one rank, called by :class:`~unbroken.worker.tracked.TrackedState`.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

from unbroken.errors import ConfigError

#: The key of the sampler's epoch in a tracked loader's state.
EPOCH_KEY = "unbroken_sampler_epoch"


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


def watch(loader: Any) -> None:
    """At ``job.track``: put an :class:`EpochGuard` on the loader's epoch sampler (once)."""
    sampler = epoch_sampler(loader)
    if sampler is not None and not isinstance(sampler.__dict__.get("set_epoch"), EpochGuard):
        sampler.set_epoch = EpochGuard(sampler, loader)


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
        guard = sampler.__dict__.get("set_epoch")
        if isinstance(guard, EpochGuard):
            guard.loaded(int(epoch))
        else:
            sampler.epoch = int(epoch)
    live = getattr(loader, "_iterator", None)
    if live is None or not state:
        loader.load_state_dict(state)
        return
    shutdown = getattr(live, "_shutdown_workers", None)
    if shutdown is not None:  # a multi-process iterator: its workers prefetched from the old position
        shutdown()
    type(live).__init__(live, loader, state)  # the iterator the script holds, now at the state's position


class EpochGuard:
    """The ``set_epoch`` of a tracked loader's sampler (an instance attribute over the class's method).

    Lives in the training thread of one rank. States: idle (calls pass through) -> armed by a load
    of epoch E (:meth:`loaded`) -> the next call is checked (see the module docstring) -> idle."""

    def __init__(self, sampler: Any, loader: Any) -> None:
        # Weak references: the sampler holds this guard, and the loader its sampler (no cycle to collect:
        # a multi-process iterator's workers go when the loader does).
        self._sampler, self._loader = weakref.ref(sampler), weakref.ref(loader)
        self._rank = getattr(sampler, "rank", "?")  # a DistributedSampler's rank
        self._armed: int | None = None  # the epoch a load set, until the next call is checked

    def _set(self, epoch: int) -> None:
        sampler = self._sampler()
        type(sampler).set_epoch(sampler, epoch)  # the class's own method

    def loaded(self, epoch: int) -> None:
        self._set(epoch)
        self._armed = epoch

    def __call__(self, epoch: int) -> None:
        if self._armed is not None:
            self._check(int(epoch), self._armed)
            self._armed = None
        self._set(epoch)

    def _check(self, epoch: int, loaded: int) -> None:
        live = getattr(self._loader(), "_iterator", None)
        rollover = live is not None and bool(getattr(live, "_finished", False))
        allowed = (loaded + 1,) if rollover else (loaded, loaded + 1)
        if epoch in allowed:
            return
        raise ConfigError(
            f"rank {self._rank}: sampler.set_epoch({epoch}) {'at an epoch rollover ' if rollover else ''}after "
            f"unbroken restored this tracked loader's sampler to epoch {loaded} (a dropped step's rollback, a "
            "replacement's own state or a checkpoint): "
            "the epoch this call sets comes from a counter that is not training state, so it was not restored "
            "with the loader, and the data order would silently differ from the fault-free run. The sampler's "
            "epoch is tracked with its loader: at each rollover write `sampler.set_epoch(sampler.epoch + 1)` "
            "(or compute the epoch from the step index) instead of counting epochs in the script")
