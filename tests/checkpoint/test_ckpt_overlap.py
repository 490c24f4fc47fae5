"""Snapshots that overlap the next step: deferred tensors copied in the background, settled at the update.

Single process: SnapshotWriter with a gate that holds its commit thread before the deferred
copy, so "the update begins while the copy is unfinished" happens every run, not by chance.
"""

from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path

import pytest
import torch
from torch import nn

from unbroken.checkpoint import memory
from unbroken.checkpoint.memory import SlotState, SnapshotWriter, read_header
from unbroken.checkpoint.memory_reader import SnapshotReader
from unbroken.checkpoint.shm_files import remove_job
from unbroken.errors import NoCheckpoint
from unbroken.worker.api import SessionHooks
from unbroken.worker.tracked import TrackedState

SHM = Path("/dev/shm")
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def gate(monkeypatch):
    """An Event the commit thread waits on before its deferred copies (set it to let them run)."""
    event = threading.Event()
    real_init = memory._Pending.__init__

    class Gated(list):
        def __iter__(self):
            event.wait(30)
            return super().__iter__()

    def init(self, later):
        real_init(self, Gated(later) if later else later)

    monkeypatch.setattr(memory._Pending, "__init__", init)
    yield event
    event.set()


def test_an_update_waiting_on_an_unfinished_copy_gets_a_consistent_snapshot(job, gate):
    weights, stats = torch.arange(1 << 16, dtype=torch.float32), torch.zeros(8)
    state = {"w": weights, "stats": stats, "step": 3}
    writer = SnapshotWriter(SHM, job, 0)
    try:
        writer.write(3, state, meta={"step": 3}, deferred={weights.data_ptr()})
        stats.fill_(7.0)  # changed in the next forward: copied at the boundary, as it was
        assert writer.unsettled and not writer.settle(timeout_s=0.2)  # the copy has not run

        updated = threading.Event()

        def update():  # the next step's optimizer update: waits for the copy, then changes w
            writer.settle()
            weights.mul_(-1.0)
            updated.set()

        t = threading.Thread(target=update)
        t.start()
        assert not updated.wait(0.3), "the update began before the deferred copy was done"
        gate.set()
        t.join(30)
        assert updated.is_set() and torch.equal(weights, -torch.arange(1 << 16, dtype=torch.float32))
        assert writer.flush(timeout_s=30) and writer.committed_step == 3
        loaded, meta = SnapshotReader(SHM, job, 0).load()
        assert meta["step"] == 3
        assert torch.equal(loaded["w"], torch.arange(1 << 16, dtype=torch.float32))  # step 3's values
        assert torch.equal(loaded["stats"], torch.zeros(8)) and loaded["step"] == 3
    finally:
        writer.close()


def test_an_unsettled_snapshot_is_never_committed_and_the_older_one_stays(job, gate):
    w = torch.full((1000,), 1.0)
    writer = SnapshotWriter(SHM, job, 0)
    try:
        writer.write(1, {"w": w})  # nothing deferred: commits on its own
        assert writer.flush(timeout_s=30) and writer.committed_step == 1
        w.fill_(2.0)
        writer.write(2, {"w": w}, deferred={w.data_ptr()})
        gate.set()  # copied, but never settled: the step ended without its update
        w.fill_(3.0)
        writer.write(3, {"w": w}, deferred={w.data_ptr()})  # abandons 2
        assert writer.committed_step == 1
        headers = [read_header(p) for p in writer.paths]
        assert sorted(h.step for h in headers if h.state == SlotState.COMMITTED) == [1]
        loaded, _ = SnapshotReader(SHM, job, 0).load()
        assert torch.equal(loaded["w"], torch.full((1000,), 1.0))
        writer.close()  # abandons 3 as well
        loaded, _ = SnapshotReader(SHM, job, 0).load()
        assert torch.equal(loaded["w"], torch.full((1000,), 1.0))
    finally:
        writer.close()


def test_a_first_snapshot_abandoned_leaves_no_checkpoint(job, gate):
    w = torch.ones(10)
    writer = SnapshotWriter(SHM, job, 0)
    writer.write(1, {"w": w}, deferred={w.data_ptr()})
    gate.set()
    writer.close()
    with pytest.raises(NoCheckpoint):
        SnapshotReader(SHM, job, 0).load()


def _hooks():
    return SessionHooks(on_phase=lambda phase, step: None, should_abort=lambda: False, defer_completion=False)


def test_only_parameters_and_optimizer_state_wait_for_the_update():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    extra = torch.zeros(2)
    tracked = TrackedState()
    for name, obj in (("model", model), ("optimizer", opt), ("extra", extra)):
        tracked.add(name, obj, _hooks())
    tree = tracked.tree()
    deferred = tracked.unchanged_until_update(tree)
    params = {p.data_ptr() for p in model.parameters()}
    opt_state = {t.data_ptr() for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)}
    assert deferred == params | opt_state and opt_state
    norm = [b.data_ptr() for b in model[1].buffers()]  # running stats: a forward moves them
    assert not deferred & set(norm)
    assert extra.data_ptr() not in deferred and tree["rng"]  # tracked tensors, RNG: at the boundary


def test_a_step_without_an_update_abandons_its_snapshot_and_turns_the_overlap_off(tmp_path):
    """The session's side (Checkpointer): settled at the update, a snapshot commits; a step that
    ends without one (parameters changed outside a tracked optimizer, say) never commits its."""
    import dataclasses

    from unbroken.worker.checkpointing import Checkpointer
    from unbroken.worker_config import ENV_JOB_ID, worker_config_from_env

    job_id = f"t{uuid.uuid4().hex[:12]}"
    cfg = worker_config_from_env({ENV_JOB_ID: job_id}, every_steps=1, save_dir=str(tmp_path / "save"))
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, shm_dir=str(SHM)))
    model = nn.Linear(64, 64)
    tracked, events = TrackedState(), []
    tracked.add("model", model, _hooks())
    ckpt = Checkpointer(cfg, managed=True, tracked=tracked, injector=None, all_min=lambda v: v,
                        event=lambda name, **fields: events.append((name, fields)), metrics={})
    try:
        assert ckpt.memory_tier and ckpt.overlap
        ckpt.after_step(1)  # the snapshot of step 1: parameters copied in the background
        assert ckpt.settle() >= 0.0  # step 2's update begins
        with torch.no_grad():
            model.weight.add_(1.0)
        ckpt.after_step(2)  # step 2 ended; its snapshot is deferred again
        with torch.no_grad():
            model.weight.add_(1.0)  # step 3 changes a parameter without an update the session sees
        ckpt.after_step(3)
        assert not ckpt.overlap and [name for name, _ in events] == ["snapshot_overlap_off"]
        ckpt.close()
        loaded, meta = SnapshotReader(SHM, job_id, cfg.rank).load()
        assert meta["step"] == 3  # written at the boundary once the overlap was off
        assert torch.equal(loaded["tracked"]["model"]["weight"], model.weight.detach())
        headers = [read_header(p) for p in ckpt_paths(job_id)]
        assert sorted(h.step for h in headers if h and h.state == SlotState.COMMITTED) == [1, 3]  # never 2
    finally:
        ckpt.close()
        remove_job(SHM, job_id)


def ckpt_paths(job_id):
    from unbroken.checkpoint.shm_files import slot_path
    return [slot_path(SHM, job_id, 0, s) for s in (0, 1)]


def test_the_commit_thread_of_a_cpu_job_yields_its_core_and_only_it(job, monkeypatch):
    """The copy and checksums run at nice 19 in their own thread; the training thread keeps its priority."""
    seen = []
    real = memory._yield_to_training

    def recording():
        real()
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    monkeypatch.setattr(memory, "_yield_to_training", recording)
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    weights = torch.arange(1 << 12, dtype=torch.float32)
    writer = SnapshotWriter(SHM, job, 0)
    try:
        writer.write(1, {"w": weights}, meta={"step": 1}, deferred={weights.data_ptr()})
        assert writer.settle(timeout_s=30) and writer.flush(timeout_s=30) and writer.committed_step == 1
    finally:
        writer.close()
    assert seen == [19]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
