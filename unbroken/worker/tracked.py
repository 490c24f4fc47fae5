"""The training state a session tracks: the objects, their state tree, and what recovers itself.

A :class:`TrackedState` lives in one rank's training thread, owned by its
:class:`~unbroken.worker.session.Job`. It holds the objects given to ``job.track()``
(modules, optimizers, schedulers, samplers, tensors) by name and turns them into the state
tree checkpoints and transfers carry (``{"tracked": {name: state_dict}, "rng": ...}``) and
back. Objects implementing :class:`~unbroken.worker.api.RecoverableState` are kept apart:
they rebuild themselves from their replicas; every other object is plain (replicated).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from unbroken.errors import CheckpointError, ConfigError
from unbroken.worker import rng
from unbroken.worker.api import RecoverableState, SessionHooks


class TrackedState:
    """The named training state of one rank (see the module docstring)."""

    def __init__(self) -> None:
        self.objects: dict[str, Any] = {}
        self.frozen = False  # set once job.steps() began: tracking more is a usage error

    def add(self, name: str, obj: Any, hooks: SessionHooks) -> None:
        """Track ``obj`` as ``name``; a recoverable object gets the session's hooks."""
        if not isinstance(obj, torch.Tensor) and not (
                hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise ConfigError(f"job.track({name}=...): a {type(obj).__name__} has no state_dict/"
                              "load_state_dict; track modules, optimizers, schedulers, samplers or tensors")
        if self.frozen:
            raise ConfigError(f"job.track({name}=...) after job.steps() started: track all state first")
        self.objects[name] = obj
        if isinstance(obj, RecoverableState):
            obj.attach(hooks)

    # -- what recovers itself, and what is plain ------------------------------------------
    def recoverable(self) -> list[RecoverableState]:
        return [o for o in self.objects.values() if isinstance(o, RecoverableState)]

    def plain(self) -> Iterator[tuple[str, Any]]:
        """(name, object) of every tracked object that is replicated as a whole."""
        return ((n, o) for n, o in self.objects.items() if not isinstance(o, RecoverableState))

    def step_pending(self) -> bool:
        """A recoverable object's committed step was cut before it completed."""
        return any(o.step_pending for o in self.recoverable())

    def has_abandoned_work(self) -> bool:
        return any(o.abandoned_work for o in self.recoverable())

    def min_replicas(self) -> int:
        """The fewest copies any recoverable object keeps (0: none tracked, full replication)."""
        return min((o.num_replicas for o in self.recoverable()), default=0)

    def drop_grads(self) -> None:
        """Forget the gradients an aborted step computed."""
        for obj in self.objects.values():
            if hasattr(obj, "zero_grad"):
                obj.zero_grad(set_to_none=True)

    # -- the state tree --------------------------------------------------------------------
    def state_of(self, obj: Any) -> Any:
        return obj if isinstance(obj, torch.Tensor) else obj.state_dict()

    def tree(self) -> dict[str, Any]:
        """The state tree of a checkpoint: every tracked object's state, and the RNG streams."""
        return {"tracked": {name: self.state_of(obj) for name, obj in self.objects.items()},
                "rng": rng.capture()}

    def load_one(self, obj: Any, state: Any) -> None:
        if isinstance(obj, torch.Tensor):
            with torch.no_grad():
                obj.copy_(state)
        else:
            obj.load_state_dict(state)

    def load_tree(self, state: dict[str, Any]) -> None:
        """Load a tree made by :meth:`tree` (CheckpointError if a tracked object has no state)."""
        tracked = state["tracked"]
        missing = sorted(set(self.objects) - set(tracked))
        if missing:
            raise CheckpointError(f"checkpoint has no state for tracked object(s) {missing} "
                                  f"(it holds {sorted(tracked)})")
        for name, obj in self.objects.items():
            self.load_one(obj, tracked[name])
        rng.restore(state["rng"])
