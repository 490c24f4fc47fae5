"""GPU checks (`pytest -m gpu`): CUDA RNG, the memory tier from device memory, NCCL abort with work pending.

Collected everywhere, skipped with a reason where no CUDA device is present (our CPU machines
and CI); `scripts/gpu_check.sh` runs them on a GPU machine. One GPU is enough: NCCL refuses two
ranks on one device, so the NCCL check uses a 1-rank group.
"""

from __future__ import annotations

import time
import uuid
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from unbroken.checkpoint.memory import SnapshotWriter
from unbroken.checkpoint.memory_reader import SnapshotReader
from unbroken.checkpoint.shm_files import remove_job
from unbroken.worker import rng

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")]


def _dropout_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5), nn.Linear(64, 8)).cuda()


def test_cuda_rng_is_restored_exactly():
    model = _dropout_model()
    x = torch.randn(32, 64, device="cuda")
    model(x)  # advance the device generator past its seed
    state = rng.capture()
    assert "cuda" in state, "a CUDA generator in use must be part of the captured RNG state"
    first = model(x)
    model(x)  # the stream moves on
    rng.restore(state)
    again = model(x)
    assert torch.equal(first, again), "dropout after the restore differs from the uninterrupted run"


def test_memory_tier_round_trips_device_tensors():
    job_id = f"g{uuid.uuid4().hex[:12]}"
    model = _dropout_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64, device="cuda")).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    try:
        writer = SnapshotWriter("/dev/shm", job_id, rank=0)
        writer.write(1, state)
        assert writer.flush(timeout_s=30)
        writer.close()
        into = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()},
                "optimizer": opt.state_dict()}
        loaded, _ = SnapshotReader("/dev/shm", job_id, 0).load(1, into=into)
        for key, value in model.state_dict().items():
            assert loaded["model"][key].device.type == "cuda"
            assert torch.equal(loaded["model"][key], value), key
    finally:
        remove_job("/dev/shm", job_id)


def test_nccl_abort_with_a_pending_collective_returns_once_the_stream_drains():
    """What ProcessGroupNCCL.abort() does with a collective queued behind a long kernel.

    Measured on an H200 (torch 2.11, NCCL of cu130): abort() blocks until the kernel ahead of
    the collective is done (~20 s here), it does not cut it short. So an abort from the wait
    path frees a rank stuck on a *peer* (the collective never completes), not one whose own
    stream is busy: docs/gpus.md. The bound here is the kernel's time plus a margin, far below
    the group's 60 s timeout."""
    store = dist.HashStore()
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=60)
    group = dist.ProcessGroupNCCL(store, 0, 1, opts)
    t = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(torch.ones(1, device="cuda"), group=group)  # warm the communicator
    torch.cuda.synchronize()
    torch.cuda._sleep(int(4e10))  # ~20 s of GPU time (at ~2 GHz) ahead of the collective on the stream
    work = group.allreduce([t])
    assert not work.is_completed()
    started = time.monotonic()
    group.abort()
    aborted_s = time.monotonic() - started
    print(f"abort returned in {aborted_s:.3f} s; the work completed: {work.is_completed()}")
    assert aborted_s < 40.0, f"abort took {aborted_s:.1f} s: longer than the kernel ahead of it"
