"""The process group a worker starts in: the job's store and generation 0's group.

Called once per process from :class:`unbroken.worker.session.Job`'s constructor, in the
training thread. Later generations' groups are built by :mod:`unbroken.worker.inflight`.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from unbroken.config import WorkerConfig
from unbroken.worker import store_client


def build(cfg: WorkerConfig, backend: str) -> tuple[dist.Store | None, dist.ProcessGroup | None, bool]:
    """(store, group, owns the default group). The store is the controller's, one per attempt,
    served over the authenticated control plane under `unbroken run` (None elsewhere); the
    caller keeps it for the life of the process (gloo's groups hold it in C++); the group is None for a replacement (it joins the
    next generation's when the regroup order comes). A default group the script built is used
    as it is (the script destroys it)."""
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
        if cfg.replacement:
            return store, None, False
    if dist.is_initialized():
        return store, dist.group.WORLD, False
    if cfg.mode == "managed":
        dist.init_process_group(backend, store=dist.PrefixStore("gen0/", store), rank=cfg.rank,
                                world_size=cfg.world_size, timeout=timeout)
    elif cfg.mode == "torchrun":
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return store, dist.group.WORLD, True
