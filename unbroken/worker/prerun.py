"""The session of a pre-run spare (``unbroken run --prerun-spares``): a Job whose rank nobody knows yet.

A pre-run spare (agent/prerun.py) runs the training script before any rank is lost, with the
job's argv and the worker environment minus everything rank-dependent (no ``RANK``,
``LOCAL_RANK``, ``GROUP_RANK``, ...). ``unbroken.init()`` there returns a :class:`PrerunJob`:

* known at once: ``job.world_size``, ``job.device`` on CPU; ``job.track(...)`` records its
  objects (the real session tracks them at assignment, before any step);
* every other member (``job.rank``, ``job.process_group``, ``job.all_reduce(...)``, ``job.steps()``,
  ``job.step()``, ``job.mesh()``, ...) is rank-dependent: the first use reports the spare ready
  (:class:`StdioOrders`: one JSON line ``{"where": "job.rank"}`` on the fd the agent gave it) and
  blocks until the agent's order assigns a rank (a line ``{"env": {...}, "argv": [...]}`` on stdin).
  It then applies the order's environment and builds the real :class:`~unbroken.worker.session.Job`,
  which does what a replacement does (register, first group, wait for the regroup order) and
  returns; the read goes on on it, and ``job.steps()`` receives the state (the transfer only).

What the script built before the block point from rank-independent inputs (a seeded model, its
optimizer) is overwritten by the transfer, as in a replacement. A value computed early from the
rank without asking unbroken (``os.environ["RANK"]``) is the unsafe case: docs/recovery.md, *Pre-run spares*.

:class:`PrerunJob` is a :class:`~unbroken.worker.session.Job` (``init()`` returns what its
annotation says) that overrides every public member of Job by name, each one building the real
session first and then going on on it (tests/worker/test_prerun_job.py checks that none is missed).

Lives in the training (main) thread of the spare's process; the blocked read is that thread.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any, Protocol

import torch

from unbroken.worker.session import Job
from unbroken.worker_config import ENV_PRERUN

#: ``where`` of a block at ``job.steps()``: all of the script before its loop ran ahead.
AT_STEPS = "job.steps()"


class Orders(Protocol):
    """How a pre-run spare tells its agent it is ready and gets its order."""

    def ready(self, where: str) -> None:
        """The script reached its first rank-dependent read ``where``."""

    def wait(self) -> dict[str, Any]:
        """Block until the order comes: ``{"env": {...}, "argv": [...]}``."""


class StdioOrders:
    """The agent's pipes: ready on ``ready_fd`` (closed after), the order as a JSON line on stdin.
    Lines without ``env`` are skipped; stdin closed without an order: the agent dropped this spare
    (it kills it too), so the process ends quietly with exit code 0."""

    def __init__(self, ready_fd: int) -> None:
        self._ready_fd = ready_fd

    def ready(self, where: str) -> None:
        if self._ready_fd < 0:
            return
        fd, self._ready_fd = self._ready_fd, -1
        try:
            os.write(fd, (json.dumps({"where": where, "pid": os.getpid()}) + "\n").encode())
        except OSError:
            pass  # the agent is gone: the order never comes, stdin ends
        finally:
            os.close(fd)

    def wait(self) -> dict[str, Any]:
        for raw in sys.stdin.buffer:
            order = json.loads(raw)
            if isinstance(order, dict) and isinstance(order.get("env"), dict):
                sys.stdin.close()
                return order
        raise SystemExit(0)


def unassigned_job(prerun: tuple[int, int], device: torch.device | None, join: Callable[[], Any]) -> PrerunJob:
    """``unbroken.init()`` in a pre-run spare; ``prerun``: (ready fd, world size) from the environment;
    ``join``: what ``init()`` does elsewhere, called once the order's environment is applied."""
    ready_fd, world_size = prerun
    return PrerunJob(world_size=world_size, device=device, orders=StdioOrders(ready_fd),
                     build=lambda order: _apply(order, join))


def _apply(order: dict[str, Any], join: Callable[[], Any]) -> Any:
    os.environ.pop(ENV_PRERUN, None)  # processes the script starts from now on are not spares
    os.environ.update({str(k): str(v) for k, v in order["env"].items()})
    return join()


class PrerunJob(Job):
    """What ``unbroken.init()`` returns in a pre-run spare (module docstring). Unassigned
    (``assigned`` False, the ``track`` calls recorded) -> the first rank-dependent use: ready
    reported, blocked, assigned (a real Job built, the recorded ``track`` calls replayed on it) ->
    every member is the real Job's. Job's constructor never runs on this object: each public member
    of Job is overridden below. Lives in the spare's training thread."""

    def __init__(self, *, world_size: int, device: torch.device | None, orders: Orders,
                 build: Callable[[dict[str, Any]], Any]) -> None:  # noqa: D107 (no Job.__init__: no rank yet)
        self.world_size = world_size
        if device is not None or not torch.cuda.is_available():  # a GPU's index is the rank's local rank
            self.device = device if device is not None else torch.device("cpu")
        self._orders, self._build = orders, build  # build(order): the real session
        self._tracks: list[tuple[dict[str, Any], tuple[str, ...], tuple[str, ...]]] = []
        self._job: Any = None
        self.blocked_at: str | None = None  # the read that waited for the order

    @property
    def assigned(self) -> bool:
        return self._job is not None

    def track(self, *, per_rank: Any = (), replicated: Any = (), **objects: Any) -> None:
        """Before assignment: recorded, tracked by the real session at assignment (before any
        step, so no hook is missed); after: the real session's ``track``."""
        if self._job is not None:
            self._job.track(per_rank=per_rank, replicated=replicated, **objects)
        else:
            self._tracks.append((dict(objects), tuple(per_rank), tuple(replicated)))

    def steps(self, total: int) -> Any:
        """The real session's ``steps(total)``; the normal block point of a pre-run spare."""
        return self._assigned(AT_STEPS).steps(total)

    # -- the rank-dependent members: the real session's, once assigned ----------------------
    @property
    def cfg(self) -> Any:
        return self._assigned("job.cfg").cfg

    @property
    def rank(self) -> int:
        return self._assigned("job.rank").rank

    @property
    def local_rank(self) -> int:
        return self._assigned("job.local_rank").local_rank

    @property
    def attempt(self) -> int:
        return self._assigned("job.attempt").attempt

    @property
    def process_group(self) -> Any:
        return self._assigned("job.process_group").process_group

    @property
    def step_completed(self) -> bool:
        return self._assigned("job.step_completed").step_completed

    @property
    def step_index(self) -> int:
        return self._assigned("job.step_index").step_index

    @property
    def data_world_size(self) -> int:
        return self._assigned("job.data_world_size").data_world_size

    @property
    def lr_scale(self) -> float:
        return self._assigned("job.lr_scale").lr_scale

    def data_ranks(self) -> tuple[int, ...]:
        return self._assigned("job.data_ranks").data_ranks()

    def sum_over_data_ranks(self, parts: dict[int, torch.Tensor]) -> torch.Tensor:
        return self._assigned("job.sum_over_data_ranks").sum_over_data_ranks(parts)

    def mesh(self, *dims: tuple[str, int], replicate: str = "dp") -> Any:
        return self._assigned("job.mesh").mesh(*dims, replicate=replicate)

    def step(self) -> Any:
        return self._assigned("job.step").step()

    def phase(self, name: str, step: int | None = None) -> None:
        self._assigned("job.phase").phase(name, step)

    def all_reduce(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._assigned("job.all_reduce").all_reduce(tensor, *args, **kwargs)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return self._assigned("job.all_gather").all_gather(tensor)

    def report_degraded(self, reason: str) -> None:
        self._assigned("job.report_degraded").report_degraded(reason)

    def report(self, **metrics: Any) -> None:
        self._assigned("job.report").report(**metrics)

    def checkpoint(self) -> None:
        self._assigned("job.checkpoint").checkpoint()

    def close(self) -> None:
        self._assigned("job.close").close()

    def _assigned(self, where: str) -> Any:
        if self._job is None:
            self.blocked_at = where
            self._orders.ready(where)
            job = self._build(self._orders.wait())
            for objects, per_rank, replicated in self._tracks:
                job.track(per_rank=per_rank, replicated=replicated, **objects)
            self._tracks.clear()
            self._job = job
        return self._job
