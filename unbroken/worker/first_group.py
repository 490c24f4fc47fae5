"""The process group a worker starts in: the job's store and generation 0's group.

Called once per process from :class:`unbroken.worker.session.Job`'s constructor, in the
training thread. Later generations' groups are built by :mod:`unbroken.worker.inflight`.

Under `unbroken run` on CPU the default group is the world
:class:`~unbroken.parallel.group.SurvivingGroup` of a :class:`~unbroken.parallel.fabric.Fabric`:
a wrapper built on the default group (stock ``DistributedDataParallel(model)``) then holds a
group that moves to each new generation, and survives an in-flight recovery. The session's
own collectives (``job.all_reduce``, transfers, ``ShardedOptimizer``) use the world group's
current gloo backend directly (:data:`Start.group`), as before.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from unbroken.parallel.fabric import Fabric
from unbroken.worker import store_client
from unbroken.worker_config import WorkerConfig

FABRIC_PREFIX = "fabric/"  # the fabric's keys on the attempt's store: fabric/gen<g>/<group>/


@dataclass
class Start:
    """What a worker starts with. ``group``: generation 0's group for the session's own
    collectives (None for a replacement: it joins the next generation's when the regroup order
    comes); ``fabric``: the job's surviving groups (None outside `unbroken run`, on CUDA, or when
    the script built the default group itself)."""

    store: dist.Store | None
    group: dist.ProcessGroup | None
    owns_default_group: bool
    fabric: Fabric | None = None


def build(cfg: WorkerConfig, backend: str, device: torch.device,
          before_reduce: Callable[[], None] | None = None,
          on_collective: Callable[[Any], None] | None = None) -> Start:
    """The store is the controller's, one per attempt, served over the authenticated control plane
    under `unbroken run` (None elsewhere); the caller keeps it for the life of the process (gloo's
    groups hold it in C++: :attr:`Start.store`). A default group the script built is used as it is
    (the script destroys it). ``before_reduce``: called before each reduction on a surviving group;
    ``on_collective``: given the work of each other collective on one."""
    timeout = timedelta(seconds=cfg.worker.pg_timeout_s)
    store = None
    if cfg.mode == "managed":
        # The store lives in the controller, one per attempt, reached only with the job secret
        # (controller/store_service.py); every key under the attempt's secret prefix
        # (controller/rendezvous.py), each generation under its own below it.
        # Not a PrefixStore around it: that would not keep the Python object alive.
        store = store_client.open_store(cfg.controller, cfg.secret, rank=cfg.rank, attempt=cfg.attempt,
                                        pid=os.getpid(), timeout_s=cfg.worker.pg_timeout_s,
                                        key_prefix=cfg.store_prefix)
        if not dist.is_initialized() and device.type == "cpu" and backend == "gloo":
            return _surviving_start(cfg, store, before_reduce, on_collective)
        if cfg.replacement:
            return Start(store, None, False)
    if dist.is_initialized():
        return Start(store, dist.group.WORLD, False)
    if cfg.mode == "managed":
        dist.init_process_group(backend, store=dist.PrefixStore("gen0/", store), rank=cfg.rank,
                                world_size=cfg.world_size, timeout=timeout)
    elif cfg.mode == "torchrun":
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return Start(store, dist.group.WORLD, True)


def _surviving_start(cfg: WorkerConfig, store: dist.Store, before_reduce: Callable[[], None] | None,
                     on_collective: Callable[[Any], None] | None = None) -> Start:
    """The default group is the fabric's world group; a first-generation rank joins generation 0
    now, a replacement stays detached until the regroup order."""
    fabric = Fabric(dist.PrefixStore(FABRIC_PREFIX, store), cfg.rank, cfg.world_size,
                    timeout_s=cfg.worker.pg_timeout_s, lazy_connect=cfg.worker.lazy_connect)
    fabric.before_reduce = before_reduce
    fabric.on_collective = on_collective
    fabric.init_world()
    if cfg.replacement:
        return Start(store, None, True, fabric)
    fabric.switch(0)  # InFlight starts every first-generation rank at 0
    return Start(store, fabric.world.backend, True, fabric)


def destroy(fabric: Fabric | None) -> None:
    """Tear down the default group this worker built (nothing may be pending on it)."""
    if fabric is not None:
        fabric.close()
    else:
        dist.destroy_process_group()
