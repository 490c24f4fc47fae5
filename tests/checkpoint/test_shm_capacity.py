"""The memory tier's capacity check: snapshot estimates before the first step, and the check
against the free bytes of the shm dir (a real small tmpfs where we may mount one)."""

from __future__ import annotations

import os
from collections import namedtuple

import pytest
import torch
from torch import nn

from tests.conftest import mounted_tmpfs
from unbroken.checkpoint import memory, shm_files
from unbroken.checkpoint.memory import SnapshotWriter
from unbroken.checkpoint.capacity import check_shm_capacity, estimate_snapshot_bytes, shm_slots_bytes
from unbroken.errors import FatalError, ShmCapacityError
from unbroken.optim import ShardedOptimizer

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 64))  # 164,928 params


def param_bytes(m: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in m.parameters())


def state(m: nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"tracked": {"model": m.state_dict(), "optimizer": opt.state_dict()}, "rng": {"torch": torch.get_rng_state()}}


def first_step(m: nn.Module, opt: torch.optim.Optimizer) -> None:
    m(torch.randn(8, 256)).pow(2).mean().backward()
    opt.step()


class FakeGroup:
    """Rank `rank` of `size` for building a ShardedOptimizer's layout; no collective is run."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


@pytest.mark.parametrize("make,state_copies", [
    (lambda ps: torch.optim.Adam(ps, lr=1e-3), 2),
    (lambda ps: torch.optim.AdamW(ps, lr=1e-3, amsgrad=True), 3),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 1),
    (lambda ps: torch.optim.SGD(ps, lr=0.1), 0),
    (lambda ps: torch.optim.RMSprop(ps, lr=0.1, centered=True), 2),
])
def test_the_estimate_before_the_first_step_counts_the_optimizer_state_to_come(make, state_copies):
    m = model()
    opt = make(m.parameters())
    before = estimate_snapshot_bytes(state(m, opt), [opt])
    expected = (1 + state_copies) * param_bytes(m)
    assert expected <= before <= expected + 64 * 1024  # the overheads: meta, scalars, alignment
    first_step(m, opt)
    after = estimate_snapshot_bytes(state(m, opt), [opt])  # measured now: the state exists
    assert expected <= after <= before


def test_an_unknown_optimizer_counts_as_two_copies_of_the_parameters():
    class Lion(torch.optim.Optimizer):  # not a torch.optim class: its state is unknown
        def __init__(self, params):
            super().__init__(params, {"lr": 1e-4})

    m = model()
    opt = Lion(m.parameters())
    assert 3 * param_bytes(m) <= estimate_snapshot_bytes(state(m, opt), [opt]) <= 3 * param_bytes(m) + 64 * 1024


def test_a_sharded_optimizer_counts_only_its_shard():
    m = model()
    opt = ShardedOptimizer(m, torch.optim.AdamW, num_replicas=1, process_group=FakeGroup(1, 4), lr=1e-3)
    shard_numel = opt.memory_report()["shard_numel"]
    assert 4 * shard_numel >= sum(p.numel() for p in m.parameters())
    missing = estimate_snapshot_bytes({}, [opt]) - estimate_snapshot_bytes({}, [])
    assert 2 * 4 * shard_numel <= missing <= 2 * 4 * shard_numel + 4096  # AdamW: 8 bytes per element


@pytest.mark.parametrize("sharded", [False, True])
def test_the_slots_estimated_before_the_first_step_hold_the_real_snapshots_after_it(tmp_path, sharded):
    m = model()
    opt = ShardedOptimizer(m, torch.optim.AdamW, num_replicas=1, lr=1e-3) if sharded \
        else torch.optim.AdamW(m.parameters(), lr=1e-3)
    estimated = shm_slots_bytes(estimate_snapshot_bytes(state(m, opt), [opt]))
    first_step(m, opt)
    writer = SnapshotWriter(tmp_path, "cap", 0)
    try:
        for step in (1, 2):  # both slots
            writer.write(step, state(m, opt))
            writer.flush()
    finally:
        writer.close()
    real = sum(os.path.getsize(p) for p in writer.paths)
    assert real <= estimated <= real + 4 * memory.GROW_ROUND_BYTES


def fake_statvfs(free_bytes: int):
    result = namedtuple("statvfs", "f_bavail f_frsize")
    return lambda path: result(free_bytes, 1)


def test_the_check_keeps_the_writers_headroom_and_counts_every_local_rank(tmp_path, monkeypatch):
    snapshot = 100 * MiB
    slots = shm_slots_bytes(snapshot)
    assert slots >= 2 * 125 * MiB  # the writer grows a slot to 1.25x what it needs
    free = 4 * slots + memory.MIN_HEADROOM_BYTES
    monkeypatch.setattr(shm_files.os, "statvfs", fake_statvfs(free))
    assert check_shm_capacity(tmp_path, "job", rank=0, snapshot_bytes=snapshot, local_world_size=4) == 4 * slots
    monkeypatch.setattr(shm_files.os, "statvfs", fake_statvfs(free - 1))
    with pytest.raises(ShmCapacityError) as info:
        check_shm_capacity(tmp_path, "job", rank=3, snapshot_bytes=snapshot, local_world_size=4)
    assert isinstance(info.value, FatalError)
    assert f"need {4 * slots} bytes" in str(info.value) and f"only {free - 1} bytes" in str(info.value)
    # Ten percent of the free bytes is kept when that is more than the minimum.
    big = 100 * memory.MIN_HEADROOM_BYTES
    monkeypatch.setattr(shm_files.os, "statvfs", fake_statvfs(big))
    with pytest.raises(ShmCapacityError, match=f"and {big // 10} bytes"):
        check_shm_capacity(tmp_path, "job", rank=0, snapshot_bytes=(big - big // 10) // 2, local_world_size=1)


def test_a_restarted_job_may_reuse_the_bytes_its_slots_already_hold(tmp_path, monkeypatch):
    snapshot = 10 * MiB
    slots = shm_slots_bytes(snapshot)
    monkeypatch.setattr(shm_files.os, "statvfs", fake_statvfs(memory.MIN_HEADROOM_BYTES))  # full
    for name in ("unbroken-job-r00000-s0", "unbroken-job-r00000-s1"):
        with open(tmp_path / name, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, slots // 2)
    (tmp_path / "unbroken-other-r00000-s0").write_bytes(b"x" * 4096)  # not this job's
    check_shm_capacity(tmp_path, "job", rank=0, snapshot_bytes=snapshot, local_world_size=1)
    with pytest.raises(ShmCapacityError):
        check_shm_capacity(tmp_path, "other", rank=0, snapshot_bytes=snapshot, local_world_size=1)


@pytest.fixture
def small_tmpfs(tmp_path):
    """An 8 MiB tmpfs (needs root and mount); skipped where it cannot be mounted."""
    with mounted_tmpfs(tmp_path / "shm", "8m") as path:
        yield path


def test_a_small_tmpfs_fails_the_check_with_what_to_do(small_tmpfs):
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    snapshot = estimate_snapshot_bytes(state(m, opt), [opt])
    with pytest.raises(ShmCapacityError) as info:
        check_shm_capacity(small_tmpfs, "job", rank=2, snapshot_bytes=snapshot, local_world_size=2)
    message = str(info.value)
    st = os.statvfs(small_tmpfs)
    assert f"only {st.f_bavail * st.f_frsize} bytes" in message and str(small_tmpfs) in message
    assert f"need {2 * shm_slots_bytes(snapshot)} bytes" in message and "rank 2" in message
    assert "--ckpt-every-steps 0" in message and "--nproc-per-node" in message and "--shm-size" in message
