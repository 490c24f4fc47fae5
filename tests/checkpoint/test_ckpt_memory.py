"""Memory tier: slot files in /dev/shm, commit protocol, SIGKILL mid-copy, corruption, cleanup."""

import logging
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from torch import nn

from unbroken.checkpoint import memory
from unbroken.checkpoint import sources as sources_module
from unbroken.checkpoint.memory import HEADER_BYTES, SnapshotWriter
from unbroken.checkpoint.memory_reader import SnapshotReader
from unbroken.checkpoint.shm_files import claim_job, remove_job, slot_path, sweep_stale
from unbroken.errors import CheckpointCorrupt, CheckpointError, ConfigError, NoCheckpoint

HERE = Path(__file__).resolve().parent
SHM = Path("/dev/shm")


def _model_and_optimizer(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 16))
    model[3].weight = model[0].weight  # tied weights
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 16, (4, 5), generator=g)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()


def _snapshot_state(model, opt, step):
    return {"model": model.state_dict(), "optimizer": opt.state_dict(),
            "rng": torch.get_rng_state(), "step": step, "loss_scale": 2.0 ** 16}


def _deep_copy(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        out = type(x)((k, _deep_copy(v)) for k, v in x.items())
        if hasattr(x, "_metadata"):
            out._metadata = x._metadata
        return out
    if isinstance(x, (list, tuple)):
        return type(x)(_deep_copy(v) for v in x)
    return x


def _assert_same(a, b, path="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.bool else a, b.view(torch.uint8)
                           if b.dtype == torch.bool else b), path
        return
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}/{i}")
    else:
        assert a == b, path


@pytest.mark.timeout(60)
def test_roundtrip_model_adamw_rng_bit_exact(job):
    model, opt = _model_and_optimizer()
    _train(model, opt, 3, seed=1)
    writer = SnapshotWriter(SHM, job, 3)
    try:
        written = {}
        for step in (3, 4, 5):
            state = _snapshot_state(model, opt, step)
            blocked_s = writer.write(step, state, meta={"loss": 1.5, "step": step})
            assert 0 <= blocked_s < 10
            written[step] = _deep_copy(state)
            _train(model, opt, 1, seed=step)  # mutates the tracked tensors in place
            assert writer.flush(timeout_s=30)
            assert writer.committed_step == step
        reader = SnapshotReader(SHM, job, 3)
        assert reader.committed() == [(5, 0), (4, 1)]  # slots alternate; step 3 overwritten
        for step in (5, 4):
            state, meta = reader.load(step)
            assert meta == {"loss": 1.5, "step": step}
            _assert_same(written[step], state)
        state, _ = reader.load()
        _assert_same(written[5], state)
        assert state["model"]["0.weight"] is state["model"]["3.weight"]  # tie kept
        with pytest.raises(NoCheckpoint, match="step 3"):
            reader.load(3)

        # Loaded tensors are copies: scribbling on them leaves the slot intact.
        state["model"]["1.weight"].fill_(123.0)
        _assert_same(written[5], reader.load()[0])

        # A fresh model + optimizer restored from the snapshot continues bit for bit.
        restored, restored_opt = _model_and_optimizer(seed=99)
        state, _ = reader.load()
        restored.load_state_dict(state["model"])
        restored_opt.load_state_dict(state["optimizer"])
        _train(restored, restored_opt, 2, seed=7)
        original, original_opt = _model_and_optimizer(seed=99)
        original.load_state_dict(written[5]["model"])
        original_opt.load_state_dict(written[5]["optimizer"])
        _train(original, original_opt, 2, seed=7)
        _assert_same(original.state_dict(), restored.state_dict())
        assert [s["state"] for s in reader.slots()] == ["COMMITTED", "COMMITTED"]
    finally:
        writer.close()


@pytest.mark.timeout(60)
def test_restarted_writer_continues_after_the_newest(job):
    with_writer = SnapshotWriter(SHM, job, 0)
    with_writer.write(1, {"x": torch.full((10,), 1.0)})
    with_writer.write(2, {"x": torch.full((10,), 2.0)})
    with_writer.close()
    writer = SnapshotWriter(SHM, job, 0)
    try:
        assert writer.committed_step == 2
        writer.write(3, {"x": torch.full((10,), 3.0)})
        writer.flush()
        assert SnapshotReader(SHM, job, 0).committed() == [(3, 0), (2, 1)]
        # After a rollback to an older step, what is written since counts as newest.
        writer.write(1, {"x": torch.full((10,), 1.5)})
        writer.flush()
        reader = SnapshotReader(SHM, job, 0)
        assert reader.committed() == [(1, 1), (3, 0)]
        assert reader.load()[0]["x"][0].item() == 1.5
    finally:
        writer.close()


@pytest.mark.timeout(60)
def test_growth_keeps_the_older_snapshot_and_grows_once(job):
    model, opt = _model_and_optimizer()
    big = {"w": torch.randn(256, 1024)}  # 1 MiB
    writer = SnapshotWriter(SHM, job, 0)
    def sizes():
        return [p.stat().st_size if p.exists() else 0 for p in writer.paths]

    try:
        writer.write(1, {"model": big})
        writer.flush()
        small_size = sizes()[0]
        # The optimizer state appears: three times the bytes.
        bigger = {"model": big, "optimizer": {"exp_avg": torch.randn(256, 1024),
                                              "exp_avg_sq": torch.randn(256, 1024)}}
        writer.write(2, bigger)
        writer.flush()
        reader = SnapshotReader(SHM, job, 0)
        _assert_same({"model": big}, reader.load(1)[0])  # the older one is still loadable
        _assert_same(bigger, reader.load()[0])
        assert sizes()[1] > 3 * (1 << 20) and sizes()[0] == small_size
        writer.write(3, bigger)  # slot 0 grows now, once
        writer.flush()
        grown = sizes()
        assert grown[0] == grown[1] >= 1.25 * 3 * (1 << 20)
        for step in (4, 5, 6):
            writer.write(step, bigger)
            writer.flush()
            assert sizes() == grown
        _assert_same(bigger, reader.load(5)[0])
        del model, opt
    finally:
        writer.close()


def _wait_for(predicate, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.0005)


@pytest.mark.timeout(60)
def test_sigkill_mid_copy_leaves_the_previous_snapshot_intact(job):
    sys.path.insert(0, str(HERE))
    try:
        from mem_worker import expected_state
    finally:
        sys.path.remove(str(HERE))
    size_mb = 200
    reader = SnapshotReader(SHM, job, 0)
    states_at_kill = []
    for round_ in range(3):
        started = time.monotonic()
        proc = subprocess.Popen([sys.executable, str(HERE / "mem_worker.py"), str(SHM), job, "0",
                                 str(size_mb)])
        try:
            before = reader.committed()[0][0] if reader.committed() else 0

            def writing():  # a copy is in progress after at least one new commit
                slots = reader.slots()
                return any(s["state"] == "WRITING" for s in slots) and \
                    max((s["step"] for s in slots if s["state"] == "COMMITTED"), default=0) > before
            _wait_for(writing, 15, f"round {round_}: the worker to start copying a snapshot")
            print(f"round {round_}: kill after {time.monotonic() - started:.1f} s")
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        finally:
            proc.kill()
            proc.wait()
        slots = reader.slots()
        states_at_kill.append(sorted(s["state"] for s in slots))
        committed = reader.committed()
        assert len(committed) == 1, slots  # the slot being written is not listed
        state, meta = reader.load()
        step = committed[0][0]
        assert meta == {"step": step} and state["step"] == step
        _assert_same(expected_state(step, size_mb), state)
    # The kill landed during the copy (not during the checksum) at least once.
    assert ["COMMITTED", "WRITING"] in states_at_kill, states_at_kill


def _two_snapshots(job):
    writer = SnapshotWriter(SHM, job, 0)
    try:
        for step in (1, 2):
            writer.write(step, {"x": torch.full((1000,), float(step)), "step": step})
    finally:
        writer.close()
    return SnapshotReader(SHM, job, 0)


@pytest.mark.timeout(60)
def test_flipped_byte_is_detected_and_load_falls_back(job, caplog):
    reader = _two_snapshots(job)
    path = slot_path(SHM, job, 0, 1)  # holds step 2
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 100)
        byte = f.read(1)
        f.seek(HEADER_BYTES + 100)
        f.write(bytes([byte[0] ^ 0x01]))
    assert reader.committed() == [(2, 1), (1, 0)]
    with pytest.raises(CheckpointCorrupt, match=f"{path}.*checksum mismatch"):
        reader.load(2)
    with caplog.at_level(logging.WARNING, logger="unbroken.checkpoint.memory_reader"):
        state, _ = reader.load()
    assert state["step"] == 1 and torch.equal(state["x"], torch.full((1000,), 1.0))
    assert any("skipping the shared-memory snapshot of step 2" in r.message for r in caplog.records)
    # A damaged header unlists the slot; with nothing left, load says so.
    with open(slot_path(SHM, job, 0, 0), "r+b") as f:
        f.seek(20)
        f.write(b"\xff")
    assert reader.committed() == [(2, 1)]
    assert reader.slots()[0]["state"] == "INVALID"
    with pytest.raises(CheckpointCorrupt, match="checksum mismatch"):
        reader.load()


@pytest.mark.timeout(60)
def test_capacity_check_names_bytes_dir_and_remedy(job, monkeypatch):
    writer = SnapshotWriter(SHM, job, 0)
    try:
        writer.write(1, {"x": torch.ones(1000)})
        writer.flush()
        real = os.statvfs(SHM)
        fake = namedtuple("statvfs", "f_bavail f_frsize f_blocks")(300 * 256, 4096, real.f_blocks)
        monkeypatch.setattr(os, "statvfs", lambda path: fake)  # 300 MiB free
        with pytest.raises(CheckpointError) as info:
            writer.write(2, {"x": torch.ones(20 << 20)})  # 80 MiB: two slots + headroom > 300
        message = str(info.value)
        assert str(SHM) in message and str(300 << 20) in message and "bytes" in message
        assert "enlarge" in message and "snapshot frequency" in message
        assert os.stat(slot_path(SHM, job, 0, 1)).st_size == 0  # nothing was allocated
        writer.write(2, {"x": torch.ones(1 << 20)})  # 4 MiB fits
        writer.flush()
        assert [s for s, _ in SnapshotReader(SHM, job, 0).committed()] == [2, 1]
    finally:
        writer.close()


@pytest.mark.timeout(60)
def test_bad_input_and_failed_write_keep_the_committed_snapshot(job):
    for bad in ("", "a/b", "../x", "x" * 65, "a b", None):
        with pytest.raises(ConfigError, match="job id"):
            SnapshotWriter(SHM, bad, 0)
    with pytest.raises(ConfigError, match="rank"):
        slot_path(SHM, job, -1, 0)
    with pytest.raises(ConfigError, match="does not exist"):
        SnapshotReader(SHM / "no-such-dir", job, 0)
    assert slot_path(None, "j.1-x_y", 7, 1) == Path("/dev/shm/unbroken-j.1-x_y-r00007-s1")
    writer = SnapshotWriter(SHM, job, 0)
    try:
        writer.write(1, {"x": torch.ones(3)})
        with pytest.raises(CheckpointError, match="not JSON-serializable"):
            writer.write(2, {"x": torch.ones(3)}, meta={"bad": object()})
        with pytest.raises(CheckpointError, match="not supported"):
            writer.write(2, {"x": object()})
        with pytest.raises(ConfigError, match="step"):
            writer.write(-1, {})
        reader = SnapshotReader(SHM, job, 0)
        assert reader.committed() == [(1, 0)] and torch.equal(reader.load()[0]["x"], torch.ones(3))
    finally:
        writer.close()


@pytest.mark.timeout(60)
def test_device_tensors_are_copied_without_host_staging(job, monkeypatch):
    """The path a CUDA state takes (tensors copied straight into the slot), forced on CPU."""
    monkeypatch.setattr(sources_module, "is_host", lambda t: False)
    model, opt = _model_and_optimizer()
    _train(model, opt, 2, seed=3)
    base = torch.randn(6, 4)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(),
             "transposed": base.t(), "bf16": torch.randn(5).to(torch.bfloat16),
             "cplx": torch.randn(3, dtype=torch.complex64), "flags": torch.tensor([True, False]),
             "scalar": torch.tensor(7), "empty": torch.zeros(0, 3)}
    sources, _ = sources_module.flatten_sources(state)
    assert all(src is not host for host, src in sources.values() if host.numel())
    writer = SnapshotWriter(SHM, job, 0)
    try:
        writer.write(1, state)
    finally:
        writer.close()
    loaded, _ = SnapshotReader(SHM, job, 0).load()
    _assert_same(_deep_copy(state), loaded)
    assert loaded["model"]["0.weight"] is loaded["model"]["3.weight"]


@pytest.mark.timeout(60)
def test_reader_never_returns_a_torn_snapshot_while_the_writer_runs(job):
    writer = SnapshotWriter(SHM, job, 0)
    reader = SnapshotReader(SHM, job, 0)
    writer.write(0, {"x": torch.zeros(1 << 18), "step": 0}, meta={"step": 0})
    writer.flush()
    stop, seen, errors = threading.Event(), [], []

    def read_loop():
        while not stop.is_set():
            try:
                state, meta = reader.load()
                value = state["x"][0].item()
                assert torch.all(state["x"] == value) and value == state["step"] == meta["step"]
                seen.append(state["step"])
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
                return

    thread = threading.Thread(target=read_loop)
    thread.start()
    try:
        x = torch.zeros(1 << 18)
        for step in range(1, 200):
            writer.write(step, {"x": x.fill_(float(step)), "step": step}, meta={"step": step})
    finally:
        stop.set()
        thread.join(30)
        writer.close()
    assert not errors, errors
    assert seen and seen == sorted(seen)


@pytest.mark.timeout(60)
def test_owner_files_modes_and_sweep(tmp_path):
    old_umask = os.umask(0)
    try:
        writer = SnapshotWriter(tmp_path, "live", 0)
        writer.write(1, {"x": torch.ones(3)})
        writer.close()
        claim_job(tmp_path, "live", os.getpid())
    finally:
        os.umask(old_umask)
    for name in ("unbroken-live-r00000-s0", "unbroken-live.owner"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o600, name
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    writer = SnapshotWriter(tmp_path, "dead.job", 2)
    writer.write(1, {"x": torch.ones(3)})
    writer.write(2, {"x": torch.ones(3)})
    writer.close()
    claim_job(tmp_path, "dead.job", finished.pid)
    (tmp_path / "someone-else").write_text("x")
    (tmp_path / "unbroken-nowner-r00000-s0").write_text("no owner file: left alone")
    with pytest.raises(CheckpointError, match="owned by live process"):
        claim_job(tmp_path, "live", finished.pid)
    assert sweep_stale(tmp_path) == ["dead.job"]
    assert sorted(os.listdir(tmp_path)) == ["someone-else", "unbroken-live-r00000-s0",
                                            "unbroken-live.owner", "unbroken-nowner-r00000-s0"]
    assert SnapshotReader(tmp_path, "live", 0).load()[0]["x"].sum() == 3
    claim_job(tmp_path, "live", os.getpid())  # re-claiming one's own job is fine
    assert [p.name for p in remove_job(tmp_path, "live")] == [
        "unbroken-live-r00000-s0", "unbroken-live.owner"]


@pytest.mark.timeout(60)
def test_writer_skips_a_slot_pinned_by_a_reader(job):
    writer = SnapshotWriter(SHM, job, 0)
    reader = SnapshotReader(SHM, job, 0)
    try:
        for step in (1, 2):
            writer.write(step, {"x": torch.full((100,), float(step))})
        writer.flush()
        slot, fd, header = reader._pin(1, set())  # the agent is still reading step 1's slot
        try:
            assert (slot, header.step) == (0, 1)
            writer.write(3, {"x": torch.full((100,), 3.0)})  # would reuse slot 0: skipped
            assert writer.flush() and writer.skipped_writes == 1 and writer.committed_step == 2
            assert reader.committed() == [(2, 1), (1, 0)]
        finally:
            os.close(fd)
        writer.write(3, {"x": torch.full((100,), 3.0)})
        writer.flush()
        assert reader.committed() == [(3, 0), (2, 1)] and writer.skipped_writes == 1
    finally:
        writer.close()


def _all_tensors(tree, path="state"):
    """{path: tensor} of every tensor leaf of a nested dict/list/tuple."""
    if isinstance(tree, torch.Tensor):
        return {path: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) \
        if isinstance(tree, (list, tuple)) else ()
    return {p: t for k, v in items for p, t in _all_tensors(v, f"{path}/{k}").items()}


@pytest.mark.timeout(60)
def test_load_into_fills_the_given_tensors_in_place_bit_exact(job):
    model, opt = _model_and_optimizer()
    _train(model, opt, 3, seed=1)
    writer = SnapshotWriter(SHM, job, 0)
    try:
        written = _snapshot_state(model, opt, 3)
        written["odd"] = torch.arange(6.0).to(torch.complex128) * 1j  # stored as raw bytes
        writer.write(3, written)
        writer.flush()
        written = _deep_copy(written)
    finally:
        writer.close()
    # A restarted worker: a new model and optimizer (other values, optimizer state built).
    fresh, fresh_opt = _model_and_optimizer(seed=5)
    _train(fresh, fresh_opt, 1, seed=2)
    into = _snapshot_state(fresh, fresh_opt, 0)
    into["odd"] = torch.zeros(6, dtype=torch.complex128)
    before = {p: (t, t.data_ptr()) for p, t in _all_tensors(into).items()}
    state, meta = SnapshotReader(SHM, job, 0).load(into=into)
    _assert_same(written, state)
    after = _all_tensors(state)
    assert after.keys() == before.keys()
    for p, (t, ptr) in before.items():
        assert after[p].data_ptr() == ptr, p  # no new allocation anywhere
        # The tie's second entry is the first's tensor; a dtype stored as raw bytes comes
        # back as a view of the given tensor.
        if p not in ("state/model/3.weight", "state/odd"):
            assert after[p] is t, p
    assert state["model"]["0.weight"] is state["model"]["3.weight"]  # the tie is kept
    _assert_same(written["model"], fresh.state_dict())  # the model itself holds the snapshot
    _assert_same(written["optimizer"]["state"], fresh_opt.state_dict()["state"])
    _assert_same(written["odd"], into["odd"])


@pytest.mark.timeout(60)
def test_load_into_falls_back_to_new_tensors_where_the_leaf_does_not_fit(job):
    _two_snapshots(job)  # step 2: {"x": 1000 x 2.0, "step": 2}
    reader = SnapshotReader(SHM, job, 0)
    for into in ({"x": torch.zeros(999)}, {"x": torch.zeros(1000, dtype=torch.float64)},
                 {"x": torch.zeros(2000)[::2]}, {"x": [torch.zeros(1000)]}, {"y": torch.zeros(1000)}):
        snapshot = _deep_copy(into)
        state, _ = reader.load(into=into)
        assert torch.equal(state["x"], torch.full((1000,), 2.0)) and state["step"] == 2
        _assert_same(snapshot, into)  # untouched
    into = {"x": torch.zeros(1000), "step": 7}  # a non-tensor leaf is ignored
    x = into["x"]
    state, _ = reader.load(1, into=into)
    assert state["x"] is x and torch.equal(x, torch.full((1000,), 1.0)) and state["step"] == 1
    # read_flat takes the targets by tensor name.
    tensors, _, _ = reader.read_flat(2, into={"x": x})
    assert tensors["x"] is x and torch.equal(x, torch.full((1000,), 2.0))
    # One tensor given for two snapshot tensors: only the first lands in it.
    writer = SnapshotWriter(SHM, job, 1)
    try:
        writer.write(1, {"a": torch.ones(10), "b": torch.full((10,), 2.0)})
    finally:
        writer.close()
    t = torch.zeros(10)
    state, _ = SnapshotReader(SHM, job, 1).load(into={"a": t, "b": t})
    assert state["a"] is t and state["b"] is not t
    assert torch.equal(t, torch.ones(10)) and torch.equal(state["b"], torch.full((10,), 2.0))


@pytest.mark.timeout(60)
def test_load_into_a_corrupt_snapshot_raises(job):
    writer = SnapshotWriter(SHM, job, 0)
    try:  # several checksum chunks, the damage in the last one
        writer.write(1, {"a": torch.ones(3 * memory.CHUNK_BYTES // 4 + 5)})
    finally:
        writer.close()
    path = slot_path(SHM, job, 0, 0)
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 3 * memory.CHUNK_BYTES + 7)
        f.write(b"\x99")
    into = {"a": torch.zeros(3 * memory.CHUNK_BYTES // 4 + 5)}
    with pytest.raises(CheckpointCorrupt, match=f"{path}.*checksum mismatch.*chunk\\(s\\) \\[3\\]"):
        SnapshotReader(SHM, job, 0).load(1, into=into)
    with pytest.raises(CheckpointCorrupt, match="checksum mismatch"):
        SnapshotReader(SHM, job, 0).load()


@pytest.mark.timeout(60)
def test_only_the_newest_due_snapshot_is_held_for_a_slow_persister(job):
    """The persister has taken nothing yet: the writer keeps the newest snapshot due to persist
    (a multiple of hold_every) and goes on in the other slot; an older due one is let go."""
    writer = SnapshotWriter(SHM, job, 0, hold_every=2)
    reader = SnapshotReader(SHM, job, 0)
    try:
        for step in range(2, 8):
            writer.write(step, {"x": torch.full((10,), float(step))})
            writer.flush()
        assert writer.skipped_writes == 0
        assert [s for s, _ in reader.committed()] == [7, 6]  # 6 is held, 7 rotates beside it
    finally:
        writer.close()
