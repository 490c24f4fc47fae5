"""Building the process group of one generation.

A generation is the set of processes that run one uninterrupted stretch of collectives;
after an in-flight recovery the next generation's group is built directly on a fresh
prefix of the job's store (FACTS.md: 1-20 ms, correct while the old op is still blocked).
Runs in the training thread of one rank.
"""

from __future__ import annotations

from datetime import timedelta
import torch
import torch.distributed as dist


def gloo_group(store: dist.Store, rank: int, size: int, timeout: timedelta, *,
               lazy_connect: bool = False) -> dist.ProcessGroupGloo:
    """A gloo group on ``store``. With ``lazy_connect`` (`--lazy-connect`, WorkerSettings; off by default) a
    pair of ranks connects on its first message (a ring all-reduce uses two peers); without it
    every pair connects before the constructor returns (N-1 connections and store lookups per
    rank: at 32 ranks on 2 cores 0.24 s vs 0.02 s lazily, benchmarks/group_build.py). The choice
    is this group's own (its device's ``lazy_init``): torch's process-wide ``TORCH_GLOO_LAZY_INIT``
    is neither read nor set, so the script's own groups keep torch's default."""
    if not lazy_connect:
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_default_device(lazy_init=True)]
    return dist.ProcessGroupGloo(store, rank, size, opts)


def generation_group(store: dist.Store, gen: int, *, rank: int, world_size: int, timeout_s: float,
                     device: torch.device, lazy_connect: bool = False) -> dist.ProcessGroup:
    """The process group of generation ``gen``: same ranks, prefix ``gen{gen}/`` on ``store``.

    NCCL for a CUDA ``device``, gloo otherwise (``lazy_connect``: see :func:`gloo_group`).
    Generation 0's prefix is also the one the default group of a managed job is built on.
    """
    prefixed = dist.PrefixStore(f"gen{gen}/", store)
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":  # pragma: no cover - needs a GPU
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    return gloo_group(prefixed, rank, world_size, timeout, lazy_connect=lazy_connect)
