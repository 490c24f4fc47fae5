"""State the script changes in its steps but did not track: found after the first step, refused.

What ``job.track()`` is not given is not captured, rolled back or handed to a replacement: an
EMA copy of the model that each step updates, a ``torch.Generator`` the step draws from, an
optimizer or scheduler left out. After a fault the job would end with exit 0 and other
results (a replacement starts that state from the script's beginning; a survivor's moved in
the dropped step and moves again in the redo). So under ``unbroken run`` the first step of a
loop is watched: the stateful objects the loop's frame names (its local and module-level
variables), other than the tracked ones and their parts, are fingerprinted when the loop
begins and compared after its first step; one that changed stops the job with a
:class:`~unbroken.errors.ConfigError` naming the variable. ``job.track(..., not_state=[name])``
declares a variable whose changes do not matter to training (a metric for logging).

Fingerprints are cheap and read no tensor data: a tensor's identity and version counter (every
in-place change moves it), an optimizer's per-parameter state, a scheduler's or a scaler's
``state_dict()``, a generator's state, a data loader iterator's count of batches (one the script
made of a loader it did not track: torch's ``DataLoader`` or torchdata's). Objects inside containers (a list of modules) are not
seen: the check catches the common omissions, it does not prove there are none.
"""

from __future__ import annotations

import random
import sys
from types import FrameType
from typing import Any, Callable, Iterable

import torch
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data.dataloader import _BaseDataLoaderIter

from unbroken.errors import ConfigError
from unbroken.worker import loaders, rollback

Fingerprint = Callable[[], Any]


def _module_tensors(module: torch.nn.Module, tracked_ids: set[int]) -> list[torch.Tensor]:
    """Its parameters and state_dict buffers that no tracked module holds."""
    out = [t for t in module.parameters() if id(t) not in tracked_ids]
    return out + [t for m in module.modules() for key, t in m._buffers.items()
                  if t is not None and key not in m._non_persistent_buffers_set and id(t) not in tracked_ids]


def _module_print(module: torch.nn.Module, tracked_ids: set[int]) -> Fingerprint | None:
    """None when a tracked module holds all of it (a DDP wrapper around a tracked module)."""
    if not _module_tensors(module, tracked_ids):
        return None
    return lambda: [(id(t), t._version) for t in _module_tensors(module, tracked_ids)]


def _optimizer_print(opt: torch.optim.Optimizer) -> Fingerprint:
    return lambda: [(id(p), sorted((k, (id(v), v._version) if isinstance(v, torch.Tensor) else repr(v))
                                   for k, v in s.items())) for p, s in opt.state.items()]


def _numpy_print(obj: Any) -> Fingerprint | None:
    np = sys.modules.get("numpy")
    if np is None:
        return None
    if isinstance(obj, np.random.Generator):
        return lambda: repr(obj.bit_generator.state)
    if isinstance(obj, np.random.RandomState):
        return lambda: repr(obj.get_state(legacy=False))
    return None


def fingerprint(obj: Any, tracked_ids: set[int]) -> Fingerprint | None:
    """How to read ``obj``'s state cheaply, when it is state a step may change (else None)."""
    if isinstance(obj, torch.nn.Module):
        return _module_print(obj, tracked_ids)
    if isinstance(obj, torch.optim.Optimizer):
        return _optimizer_print(obj)
    if isinstance(obj, (LRScheduler, torch.amp.GradScaler)):
        return lambda: repr(obj.state_dict())
    if isinstance(obj, torch.Generator):
        return lambda: bytes(obj.get_state().numpy())
    if isinstance(obj, _BaseDataLoaderIter):  # an iterator of a loader nobody tracks: its position
        return lambda: obj._num_yielded
    if isinstance(obj, random.Random) and obj is not random._inst:  # (the global one: tracked for you)
        return obj.getstate
    return _numpy_print(obj)


class _Watch:
    """Objects' fingerprints taken now, to compare with later ones (:meth:`changed`)."""

    def __init__(self, named: Iterable[tuple[str, Any, Fingerprint | None]]) -> None:
        self._prints = [(name, obj, read, read()) for name, obj, read in named if read is not None]

    def changed(self) -> list[str]:
        """'name (Type)' of each watched object whose state is not what it was."""
        return [f"{name} ({type(obj).__name__})" for name, obj, read, before in self._prints
                if read() != before and not self._covered(obj, read, before)]

    def _covered(self, obj: Any, read: Fingerprint, before: Any) -> bool:
        return False


class FirstStepWatch(_Watch):
    """The untracked stateful objects a loop's frame names, fingerprinted when it began.

    One that a tracked object of the script's own holds in an attribute (a data source keeping its
    ``torch.Generator``) is covered when loading that object's state from when the loop began puts
    it back there too (its ``state_dict`` holds it): tried only for what changed, then undone.

    And a data loader iterator the first step made and left part-way (``it = iter(loader)`` inside
    the loop, then ``next(it)`` each step) of a loader tracking does not cover is named too: it had no
    fingerprint when the loop began, but its position is state all the same."""

    def __init__(self, frame: FrameType | None, tracked_ids: set[int], not_state: Iterable[str],
                 tracked: dict[str, Any] | None = None, covered_now: Callable[[], set[int]] | None = None) -> None:
        """``tracked_ids``: what tracking covers (TrackedState.covered_ids); ``tracked``: the tracked objects;
        ``covered_now``: what it covers when the first step ended (a tracked loader's new iterator)."""
        skip = set(not_state)
        self._frame, self._skip, self._covered_now = frame, skip, covered_now
        names: dict[int, tuple[str, Any]] = {}
        if frame is not None:
            for scope in (frame.f_globals, frame.f_locals):
                for name, obj in scope.items():
                    if not name.startswith("__") and name not in skip and id(obj) not in tracked_ids:
                        names.setdefault(id(obj), (name, obj))
        super().__init__((name, obj, fingerprint(obj, tracked_ids)) for name, obj in names.values())
        watched = {id(obj) for _, obj, _, _ in self._prints}
        self._holders: dict[int, list[tuple[Any, Any]]] = {}  # id(watched) -> [(tracked holder, its state then)]
        for holder in (tracked or {}).values():
            if isinstance(holder, (torch.nn.Module, torch.optim.Optimizer)) or loaders.is_loader(holder):
                continue
            held = [id(v) for v in getattr(holder, "__dict__", {}).values() if id(v) in watched]
            if held and hasattr(holder, "load_state_dict"):
                start = rollback.snapshot(holder.state_dict())
                for key in held:
                    self._holders.setdefault(key, []).append((holder, start))

    def changed(self) -> list[str]:
        frame, self._frame = self._frame, None
        out = super().changed()
        if frame is None or self._covered_now is None:
            return out
        covered, watched = self._covered_now(), {id(obj) for _, obj, _, _ in self._prints}
        for scope in (frame.f_globals, frame.f_locals):
            for name, obj in scope.items():
                if (isinstance(obj, _BaseDataLoaderIter) and name not in self._skip and id(obj) not in covered
                        and id(obj) not in watched and _part_way(obj)):
                    watched.add(id(obj))
                    out.append(f"{name} ({type(obj).__name__})")
        return out

    def _covered(self, obj: Any, read: Fingerprint, before: Any) -> bool:
        for holder, start in self._holders.get(id(obj), ()):
            now = rollback.snapshot(holder.state_dict())
            holder.load_state_dict(rollback.snapshot(start))
            back = read() == before
            holder.load_state_dict(now)
            if back:
                return True
        return False


def _part_way(it: _BaseDataLoaderIter) -> bool:
    """Whether a loader iterator yielded some batches and is not through its pass (one an evaluation
    made and read to its end holds no position that matters)."""
    try:
        return 0 < it._num_yielded < len(it)
    except TypeError:  # an iterable dataset: no length
        return it._num_yielded > 0


def _plain_print(obj: Any) -> Fingerprint | None:
    """A tracked tensor's version; another tracked object's state_dict() (not a loader's: reading
    one may start an iterator)."""
    if isinstance(obj, torch.Tensor):
        return lambda: (id(obj), obj._version)
    if loaders.is_loader(obj) or not hasattr(obj, "state_dict"):
        return None
    return lambda: repr(obj.state_dict())


class TrackedWatch(_Watch):
    """The tracked objects' fingerprints now (a reduction after the step's update began). A module's
    include its layers' train/eval modes: ``model.eval()`` before a validation all-reduce and
    ``model.train()`` after it is a change a step cut inside that reduction would miss."""

    def __init__(self, tracked: dict[str, Any]) -> None:
        super().__init__((name, obj, _with_modes(obj, fingerprint(getattr(obj, "generator", obj), set())
                                                 or _plain_print(obj))) for name, obj in tracked.items())


def _with_modes(obj: Any, read: Fingerprint | None) -> Fingerprint | None:
    if not isinstance(obj, torch.nn.Module):
        return read
    return lambda: (read() if read is not None else None, [m.training for m in obj.modules()])


def refuse_changed(changed: list[str], rank: int) -> None:
    if changed:
        raise ConfigError(
            f"rank {rank}: the first step changed {', '.join(changed)}, which job.track() was not given: after a "
            f"fault it would not be rolled back or handed to a replacement, and the run would end with other "
            f"results. Track it (job.track(..., name=obj): torch and numpy generators too), or, when it is not "
            f"training state (a metric for logging) or an object of yours that you track saves it, name it in "
            f"job.track(..., not_state=[...])")
