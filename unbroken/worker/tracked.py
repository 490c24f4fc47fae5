"""The training state a session tracks: the objects, their state tree, and what recovers itself.

A :class:`TrackedState` lives in one rank's training thread, owned by its
:class:`~unbroken.worker.session.Job`. It holds the objects given to ``job.track()``
(modules, optimizers, schedulers, samplers, tensors) by name and turns them into the state
tree checkpoints and transfers carry (``{"tracked": {name: state_dict}, "rng": ...}``) and
back. Objects implementing :class:`~unbroken.worker.api.RecoverableState` are kept apart:
they rebuild themselves from their replicas; every other object is *plain*.

Whose state (DESIGN.md section 11): modules, torch optimizers, LR schedulers,
RecoverableState objects and tensors are **replicated** (equal on every data-parallel rank;
a replacement gets them from a live replica). Every other object (samplers, loaders, user
objects) and the RNG streams are **per rank** (the safe default: a replacement gets *its
own* copy, kept by the controller). ``job.track(..., per_rank=[...], replicated=[...])``
overrides the default for plain objects by name. A torchdata ``StatefulDataLoader``'s state also
holds its sampler's epoch, and loading it repositions the iterator the script holds
(:mod:`unbroken.worker.loaders`).

What rolls back when a step is dropped: every object the commit rule does not cover (all
but modules, torch optimizers and RecoverableState objects), and the RNG streams.

One part of a module is per rank and may change inside a step: its buffers (the ones its
state_dict holds), which a forward moves with the rank's own batch: BatchNorm's running
statistics, and any buffer a script's module updates in its forward (a running mean, a counter).
They travel with the per-rank state (key ``buffers``), so a dropped step puts them back, and a
replaced rank gets its own (with a DDP's ``broadcast_buffers``, rank 0's are the ones every rank's
next forward starts from). Buffers a step moves after its update (an ``AveragedModel``'s average and
count) are per rank too: the controller then sees each rank's state move after its update and
refuses to resume a rank lost there from its state after compute (controller/rank_state.py).
Buffers outside the state_dict (``persistent=False``: masks, caches)
are not state and are left alone; so are DTensor buffers (none of torch's wrappers makes them).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch.amp import grad_scaler
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LRScheduler

from unbroken.errors import CheckpointError, ConfigError
from unbroken.parallel import dtensor_state
from unbroken.worker import loaders, rng
from unbroken.worker.api import RecoverableState, SessionHooks


class _Layout(NamedTuple):
    """What a capture reads: the replicated objects that roll back, the per-rank objects (by name),
    and (tracked name, prefix, layer) of the tracked modules' layers holding buffers."""

    local: list[str]
    per_rank: list[str]
    buffer_layers: list[tuple[str, str, torch.nn.Module]]
    sharded: frozenset[str]  # the names of objects holding DTensors (their state: local shards only)
    partial: str | None  # a replicated object some rank holds only part of (see TrackedState.partial_object)


class TrackedState:
    """The named training state of one rank (see the module docstring)."""

    def __init__(self) -> None:
        self.objects: dict[str, Any] = {}
        self.per_rank: set[str] = set()  # names of the per-rank objects (see the module docstring)
        self.frozen = False  # set once job.steps() began: tracking more is a usage error
        self._rng = rng.StreamReader()  # reads the RNG streams, reusing what did not move
        self._kept_layout: _Layout | None = None  # kept once frozen (see _layout)

    def add(self, name: str, obj: Any, hooks: SessionHooks) -> None:
        """Track ``obj`` as ``name``; a recoverable object gets the session's hooks; a torch or numpy
        random generator is tracked through its state (per rank)."""
        if rng.is_generator(obj):
            obj = rng.GeneratorState(obj)
        if not isinstance(obj, torch.Tensor) and not (
                hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            hint = (" (a DistributedSampler: track the torchdata StatefulDataLoader built on it instead; the "
                    "sampler's epoch is tracked with the loader)") if hasattr(obj, "set_epoch") else ""
            raise ConfigError(f"job.track({name}=...): a {type(obj).__name__} has no state_dict/"
                              f"load_state_dict{hint}; track modules, optimizers, schedulers, samplers or tensors")
        if self.frozen:
            raise ConfigError(f"job.track({name}=...) after job.steps() started: track all state first")
        self.objects[name] = obj
        self.per_rank.discard(name)
        if _per_rank_by_default(obj):
            self.per_rank.add(name)
        if isinstance(obj, RecoverableState):
            obj.attach(hooks)
        if loaders.is_loader(obj):
            loaders.watch(obj, hooks.fail)  # its sampler's epoch is state: see unbroken.worker.loaders
        else:
            loaders.watch_held(obj)  # a loader inside the script's own data object

    def classify(self, per_rank: Iterable[str], replicated: Iterable[str]) -> None:
        """Override the default class of tracked plain objects by name (ConfigError if a name is
        not tracked, named twice, or names an object the commit rule covers)."""
        per_rank, replicated = name_list("per_rank", per_rank), name_list("replicated", replicated)
        both = sorted(per_rank & replicated)
        if both:
            raise ConfigError(f"job.track(): {both} named in both per_rank and replicated; name each once")
        for name in sorted(per_rank | replicated):
            if name not in self.objects:
                raise ConfigError(f"job.track(): per_rank/replicated name {name!r} is not a tracked object "
                                  f"(tracked: {sorted(self.objects)})")
        for name in sorted(per_rank):
            if _committed_state(self.objects[name]) or isinstance(self.objects[name], torch.Tensor):
                raise ConfigError(f"job.track(): {name!r} (a {type(self.objects[name]).__name__}) cannot be per "
                                  "rank: modules, optimizers, recoverable state and tensors are replicated")
        self.per_rank = (self.per_rank | per_rank) - replicated

    def covered_ids(self) -> set[int]:
        """``id()`` of every object tracking covers: the tracked objects, a tracked generator, and the
        submodules, parameters and buffers of tracked modules, the live iterators of tracked loaders
        (for unbroken.worker.untracked)."""
        out = set()
        for obj in self.objects.values():
            out.add(id(obj))
            if isinstance(obj, rng.GeneratorState):
                out.add(id(obj.generator))
            elif isinstance(obj, torch.nn.Module):
                out.update(id(m) for m in obj.modules())
                out.update(id(t) for t in obj.parameters())
                out.update(id(t) for t in obj.buffers())
            else:  # a tracked loader's live iterator, or one a tracked object of the script's holds
                out.update(id(x) for x in loaders.iterators_of(obj))
        return out

    # -- what recovers itself, and what is plain ------------------------------------------
    def recoverable(self) -> list[RecoverableState]:
        return [o for o in self.objects.values() if isinstance(o, RecoverableState)]

    def plain(self) -> Iterator[tuple[str, Any]]:
        """(name, object) of every tracked object that is replicated as a whole."""
        return ((n, o) for n, o in self.objects.items()
                if not isinstance(o, RecoverableState) and n not in self.per_rank)

    def per_rank_tree(self) -> dict[str, Any]:
        """This rank's own state: the per-rank objects and the RNG streams, as they are now."""
        layout = self._layout()
        states, streams = self._states(layout.per_rank, layout.sharded)
        return self._with_buffers({"objects": states, "rng": streams})

    def step_start(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(:meth:`rollback_tree`, :meth:`per_rank_tree`) of now, in one pass."""
        layout = self._layout()
        states, streams = self._states(layout.local + layout.per_rank, layout.sharded)
        return ({n: states[n] for n in layout.local},
                self._with_buffers({"objects": {n: states[n] for n in layout.per_rank}, "rng": streams}))

    def _layout(self) -> _Layout:
        """Which tracked objects a step's capture reads, and the layers of the tracked modules with buffers.
        Kept once job.steps() has begun (the objects are frozen and the model is built): walking a
        module tree costs more than the rest of a step's capture."""
        if self._kept_layout is not None:
            return self._kept_layout
        per_rank = sorted(self.per_rank)
        local = [n for n, o in self.objects.items() if n not in self.per_rank and not _committed_state(o)]
        buffer_layers = [(name, prefix, layer) for name, obj in self.objects.items() if isinstance(obj, torch.nn.Module)
                         for prefix, layer in obj.named_modules() if layer._buffers]
        sharded = frozenset(n for n in local + per_rank if dtensor_state.has_dtensors(self.objects[n]))
        partial = next((f"{n!r} ({type(o).__name__})" for n, o in self.objects.items() if n not in self.per_rank
                        and (isinstance(o, RecoverableState) or dtensor_state.has_dtensors(o))), None)
        layout = _Layout(local, per_rank, buffer_layers, sharded, partial)
        if self.frozen:
            self._kept_layout = layout
        return layout

    def partial_object(self) -> str | None:
        """A tracked object that is not per-rank and that some rank holds only part of (a recoverable
        one such as the sharded optimizer, or one holding DTensors: FSDP2, tensor parallel), named; None
        when every rank holds each of them whole, so that a step's update made on one rank is every
        rank's (worker/commit.py)."""
        return self._layout().partial

    def _with_buffers(self, tree: dict[str, Any]) -> dict[str, Any]:
        """``tree`` with the tracked modules' buffers (see the module docstring)."""
        buffers: dict[str, dict[str, torch.Tensor]] = {}
        for name, key, t in self._buffers():
            if not isinstance(t, DTensor):
                buffers.setdefault(name, {})[key] = t  # live tensors: a capture snapshots them
        return {**tree, "buffers": buffers} if buffers else tree

    def _buffers(self) -> Iterator[tuple[str, str, torch.Tensor]]:
        """(tracked name, key, tensor) of every state_dict buffer of the tracked modules, looked up by
        name at each read (a forward may give a buffer's name another tensor)."""
        for name, prefix, layer in self._layout().buffer_layers:
            skip = layer._non_persistent_buffers_set
            for key, t in layer._buffers.items():
                if t is not None and key not in skip:
                    yield name, f"{prefix}.{key}" if prefix else key, t

    def _states(self, names: list[str], sharded: frozenset[str] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """The states of ``names`` and the RNG streams as they were before reading them (``sharded``:
        the names among them that hold DTensors, when the caller knows; else each is asked). Reading
        must not move the streams: some objects draw from the global RNG in ``state_dict()``
        (a StatefulDataLoader without a live iterator creates one there), which would make a run
        that reads state at other moments (a rollback, a restart) draw differently from one that
        does not. torch's and Python's streams are put back after the reads."""
        streams = self._rng.capture()
        if sharded is None:
            states = {n: self.state_of(self.objects[n]) for n in names}
        else:  # the step's reads: the layout knows which objects are sharded
            objects = self.objects
            states = {n: (self.state_of(objects[n]) if n in sharded else _plain_state(objects[n])) for n in names}
        if names:
            self._rng.put_back(streams)
        return states, streams

    def load_per_rank(self, tree: dict[str, Any]) -> None:
        """Load a tree made by :meth:`per_rank_tree` (CheckpointError if an object is missing)."""
        self._load_objects(tree["objects"], sorted(self.per_rank), "per-rank state")
        self._rng.restore(tree["rng"])
        for name, stats in tree.get("buffers", {}).items():
            module = self.objects.get(name)
            if not isinstance(module, torch.nn.Module):
                raise CheckpointError(f"per-rank state has buffers for {name!r}, which is not a tracked module")
            with torch.no_grad():
                for key, value in stats.items():
                    module.get_buffer(key).copy_(value)

    def with_per_rank(self, tree: dict[str, Any], per_rank: dict[str, Any]) -> dict[str, Any]:
        """A :meth:`tree` with another rank's per-rank part (from :meth:`per_rank_tree`) in it."""
        return {"tracked": {**tree["tracked"], **per_rank["objects"]}, "rng": rng.portable(per_rank["rng"])}

    def rollback_tree(self) -> dict[str, Any]:
        """The replicated objects that may change inside a step (not modules, optimizers or
        recoverable state), as they are now."""
        return {n: self.state_of(o) for n, o in self.objects.items()
                if n not in self.per_rank and not _committed_state(o)}

    def load_rollback(self, local: dict[str, Any], per_rank: dict[str, Any]) -> None:
        """Put back a step start: ``local`` from :meth:`rollback_tree`, ``per_rank`` from
        :meth:`per_rank_tree`."""
        self._load_objects(local, sorted(local), "step-start capture")
        self.load_per_rank(per_rank)

    def _load_objects(self, states: dict[str, Any], names: list[str], what: str) -> None:
        missing = sorted(set(names) - set(states))
        if missing:
            raise CheckpointError(f"{what} has no state for tracked object(s) {missing} (it holds {sorted(states)})")
        for name in names:
            self.load_one(self.objects[name], states[name])

    def step_pending(self) -> bool:
        """A recoverable object's committed step was cut before it completed."""
        return any(o.step_pending for o in self.recoverable())

    def has_abandoned_work(self) -> bool:
        return any(o.abandoned_work for o in self.recoverable())

    def min_replicas(self, world_size: int) -> int:
        """The fewest copies any recoverable or sharded object keeps (0: none, full replication)."""
        counts = [o.num_replicas for o in self.recoverable()]
        for _, obj in self.plain():
            classes = self.shard_classes(obj, world_size)
            if classes is not None:
                counts.append(dtensor_state.num_replicas(classes))
        return min(counts, default=0)

    def drop_grads(self) -> None:
        """Forget what an aborted step computed outside the state that rolls back: the gradients, and
        which optimizers a GradScaler unscaled in it (a record its state_dict leaves out: a redo that
        kept it would skip the unscale and step on scaled gradients)."""
        for obj in self.objects.values():
            if hasattr(obj, "zero_grad"):
                obj.zero_grad(set_to_none=True)
            elif isinstance(obj, torch.amp.GradScaler):
                _forget_unscaled(obj)

    # -- the state tree --------------------------------------------------------------------
    def state_of(self, obj: Any) -> Any:
        """``obj``'s state; for a sharded object (FSDP2's DTensors) this rank's local shards only."""
        state = _plain_state(obj)
        sharded = not isinstance(obj, torch.Tensor) and dtensor_state.has_dtensors(obj)
        return dtensor_state.local_tree(state) if sharded else state

    def tree(self) -> dict[str, Any]:
        """The state tree of a checkpoint: every tracked object's state, and the RNG streams."""
        states, streams = self._states(list(self.objects))
        return {"tracked": states, "rng": rng.portable(streams)}

    def unchanged_until_update(self, tree: dict[str, Any]) -> set[int]:
        """``data_ptr()`` of the tensors of ``tree`` (from :meth:`tree`) that stay as they are until
        the next step's update begins: the parameters of tracked modules, and the state of tracked
        optimizers and recoverable objects (the commit rule covers them). Not in it: norm
        statistics and other buffers (a forward moves them; DDP broadcasts them), tracked tensors,
        the RNG streams and every other object's state."""
        out: set[int] = set()
        for name, obj in self.objects.items():
            if isinstance(obj, torch.nn.Module) and not isinstance(obj, RecoverableState):
                params = {p.data_ptr() for p in obj.parameters()}
                out.update(t.data_ptr() for t in _tensors(tree["tracked"][name]) if t.data_ptr() in params)
            elif _committed_state(obj):
                out.update(t.data_ptr() for t in _tensors(tree["tracked"][name]))
        return out

    def load_one(self, obj: Any, state: Any) -> None:
        if isinstance(obj, torch.Tensor):
            with torch.no_grad():
                obj.copy_(state)
        elif isinstance(obj, torch.nn.Module) and dtensor_state.has_dtensors(obj):
            dtensor_state.load_module(obj, state)  # local shards into the module's own, in place
        elif isinstance(obj, torch.optim.Optimizer) and dtensor_state.has_dtensors(obj):
            dtensor_state.load_optimizer(obj, state)
        elif loaders.is_loader(obj):
            loaders.load(obj, state)  # the script's live iterator follows, and the sampler's epoch
        else:
            obj.load_state_dict(state)

    def shard_classes(self, obj: Any, world_size: int) -> list[tuple] | None:
        """For a sharded object (DTensors over a mesh), each rank's class of identical holders
        (:func:`unbroken.parallel.dtensor_state.shard_classes`); None when it is replicated whole."""
        if not isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
            return None
        return dtensor_state.shard_classes(obj, world_size)

    def load_tree(self, state: dict[str, Any]) -> None:
        """Load a tree made by :meth:`tree` (CheckpointError if a tracked object has no state)."""
        tracked = state["tracked"]
        missing = sorted(set(self.objects) - set(tracked))
        if missing:
            raise CheckpointError(f"checkpoint has no state for tracked object(s) {missing} "
                                  f"(it holds {sorted(tracked)})")
        for name, obj in self.objects.items():
            self.load_one(obj, tracked[name])
        self._rng.restore(state["rng"])


def _forget_unscaled(scaler: torch.amp.GradScaler) -> None:
    """What ``GradScaler.update()`` clears for the next iteration, without updating the scale (torch
    2.13's private per-optimizer record)."""
    scaler._per_optimizer_states = defaultdict(grad_scaler._refresh_per_optimizer_state)


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    """The tensor leaves of a state tree (dicts, lists, tuples)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for value in x.values():
            yield from _tensors(value)
    elif isinstance(x, (list, tuple)):
        for value in x:
            yield from _tensors(value)


def _plain_state(obj: Any) -> Any:
    """The state of an object that holds no DTensors (see TrackedState.state_of)."""
    if isinstance(obj, torch.Tensor):
        return obj
    return loaders.state_of(obj) if loaders.is_loader(obj) else obj.state_dict()


def _committed_state(obj: Any) -> bool:
    """Covered by the commit rule (unchanged until the step commits): needs no rollback copy."""
    return isinstance(obj, (torch.nn.Module, torch.optim.Optimizer, RecoverableState))


def _per_rank_by_default(obj: Any) -> bool:
    return not (_committed_state(obj) or isinstance(obj, (torch.Tensor, LRScheduler)))


def name_list(what: str, names: Iterable[str]) -> set[str]:
    """The names given to ``job.track({what}=...)`` (ConfigError unless a collection of strings)."""
    if isinstance(names, str):
        raise ConfigError(f"job.track({what}=...): give a list of names, not the string {names!r}")
    out = set(names)
    bad = sorted(repr(n) for n in out if not isinstance(n, str))
    if bad:
        raise ConfigError(f"job.track({what}=...): names must be strings, got {', '.join(bad)}")
    return out
