"""The process group a worker starts in: the job's store and generation 0's group.

Called once per process from :class:`unbroken.worker.session.Job`'s constructor, in the
training thread. Later generations' groups are built by :mod:`unbroken.worker.inflight`.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from unbroken.config import WorkerConfig


def build(cfg: WorkerConfig, backend: str) -> tuple[dist.Store | None, dist.ProcessGroup | None, bool]:
    """(store, group, owns the default group). The store is the controller's, one per attempt,
    under `unbroken run` (None elsewhere); the group is None for a replacement (it joins the
    next generation's when the regroup order comes). A default group the script built is used
    as it is (the script destroys it)."""
    timeout = timedelta(seconds=cfg.worker.pg_timeout_s)
    store = None
    if cfg.mode == "managed":
        # The store lives in the controller, one per attempt; every key under the attempt's
        # secret prefix (controller/rendezvous.py), each generation under its own below it.
        tcp = dist.TCPStore(cfg.master_addr, cfg.master_port, world_size=cfg.world_size,
                            is_master=False, timeout=timeout)
        store = dist.PrefixStore(f"{cfg.store_prefix}/", tcp)
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
