"""The random streams inside a tracked loader's worker processes, kept as those workers' state.

A torchdata ``StatefulDataLoader`` with ``num_workers > 0`` snapshots each worker's position and,
when the dataset has ``state_dict``/``load_state_dict``, the dataset's state *in that worker*
(taken right after the worker fetched the batch the snapshot belongs to). It does not keep the
worker's random streams: a restored worker is seeded again from the loader's base seed, as at
the start of the epoch, so a rank that resumes mid-epoch (a replacement, a survivor's rollback,
a restart) would draw other augmentations than the fault-free run did.

For a tracked loader, :class:`WorkerStreams` wraps the loader's ``worker_init_fn``. In each worker,
after the script's own init function, it gives the worker's copy of the dataset a
``state_dict`` that also holds the worker's global streams (torch's CPU stream, Python's
``random``, numpy's global ``RandomState``) whenever one moved since the worker started: torchdata
then carries them with the worker's snapshots into ``loader.state_dict()``, and puts them back
in the restored worker before it fetches. A dataset with its own state keeps it, under
:data:`DATASET_KEY`. The random stream is plain torch's, unchanged.

Covered: map-style datasets, and iterable ones with their own ``state_dict``/``load_state_dict``
(torchdata restores their state, exact when ``iter()`` itself draws nothing). An iterable dataset
without state (``__iter__`` a generator function, the usual form) is left alone: torchdata replays a
restored worker from its start, from the same seed, and the draws replay with it; a ``state_dict``
given to it would end that replay and lose the position. Not covered: a generator object the dataset owns (``np.random.default_rng`` made in the worker): give the dataset
``state_dict``/``load_state_dict`` that hold it (torchdata keeps it per worker), or draw from the
global streams.

The wrapper runs in the loader's worker processes (and is pickled to them under ``spawn``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from unbroken.errors import ConfigError
from unbroken.worker import rng

#: The worker's streams in the dataset state a worker reports (None: none moved since it started).
STREAMS_KEY = "unbroken_worker_streams"
#: The dataset's own state beside them, when it has one.
DATASET_KEY = "dataset"


class WorkerStreams:
    """A loader's ``worker_init_fn``: the script's own (``init``, may be None), then the streams kept."""

    def __init__(self, init: Callable[[int], Any] | None) -> None:
        self.init = init

    def __call__(self, worker_id: int) -> None:
        from torch.utils.data import get_worker_info

        if self.init is not None:
            self.init(worker_id)
        dataset = get_worker_info().dataset
        cls = type(dataset)
        if not _keeps_position(dataset):
            return
        try:
            if not getattr(cls, "_unbroken_streams", False):
                dataset.__class__ = _keeping_streams(cls)
            dataset._unbroken_reader = reader = rng.StreamReader()
        except (TypeError, AttributeError) as err:  # a class whose instances take no new class or attribute
            raise ConfigError(
                f"unbroken cannot keep the random streams of this loader worker with its dataset, a {cls.__qualname__} "
                f"({err}); a rank resuming mid-epoch would draw other augmentations than the fault-free run. Use a "
                "dataset class whose instances take attributes (no __slots__ without __dict__), or num_workers=0"
            ) from err
        dataset._unbroken_started = reader.capture()  # seeded by torchdata, then the script's init


def _keeps_position(dataset: Any) -> bool:
    """Whether torchdata restores a worker of ``dataset`` from a state (so its streams must travel with
    it), rather than replaying it from its start: a map-style dataset, or an iterable one with
    ``state_dict``/``load_state_dict``."""
    from torch.utils.data import IterableDataset

    cls = type(dataset)
    return not isinstance(dataset, IterableDataset) or all(
        callable(getattr(cls, name, None)) for name in ("state_dict", "load_state_dict"))


def wrap(loader: Any) -> None:
    """Make ``loader``'s workers keep their streams (once per loader)."""
    if not isinstance(loader.worker_init_fn, WorkerStreams):
        loader.worker_init_fn = WorkerStreams(loader.worker_init_fn)


def _streams(dataset: Any) -> dict[str, Any] | None:
    reader = dataset._unbroken_reader
    now, started = reader.capture(), dataset._unbroken_started
    if all(now[name] is started.get(name) for name in now):  # the reader reuses a stream's form until it moves
        return None
    return rng.portable(now)


def _state_dict(self: Any) -> dict[str, Any]:
    state: dict[str, Any] = {STREAMS_KEY: _streams(self)}
    own = getattr(super(type(self), self), "state_dict", None)
    if own is not None:
        state[DATASET_KEY] = own()
    return state


def _load_state_dict(self: Any, state: dict[str, Any]) -> None:
    own = getattr(super(type(self), self), "load_state_dict", None)
    if STREAMS_KEY not in state:  # a snapshot without streams (written before they were kept): the dataset's own
        if own is not None:
            own(state)
        return
    if DATASET_KEY in state and own is not None:
        own(state[DATASET_KEY])
    if state[STREAMS_KEY] is not None:
        self._unbroken_reader.restore(state[STREAMS_KEY])


@functools.cache
def _keeping_streams(cls: type) -> type:
    """``cls`` with the worker's streams in its ``state_dict`` (one class per dataset class)."""
    return type(cls.__name__, (cls,), {"state_dict": _state_dict, "load_state_dict": _load_state_dict,
                                       "_unbroken_streams": True, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})
