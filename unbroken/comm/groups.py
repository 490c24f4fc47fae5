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


def generation_group(store: dist.Store, gen: int, *, rank: int, world_size: int, timeout_s: float,
                     device: torch.device) -> dist.ProcessGroup:
    """The process group of generation ``gen``: same ranks, prefix ``gen{gen}/`` on ``store``.

    NCCL for a CUDA ``device``, gloo otherwise. Generation 0's prefix is also the one the
    default group of a managed job is built on.
    """
    prefixed = dist.PrefixStore(f"gen{gen}/", store)
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":  # pragma: no cover - needs a GPU
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
