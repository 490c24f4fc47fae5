"""Storage tier: commit protocol, verification, skipping bad steps, retention, modes, ENOSPC."""

import errno
import json
import logging
import os
import stat

import pytest
import torch

from unbroken.checkpoint.storage import MANIFEST, StorageTier, describe
from unbroken.errors import CheckpointCorrupt, CheckpointError, ConfigError


def _state(step, rank=0):
    g = torch.Generator().manual_seed(step * 100 + rank)
    return {"model": {"w": torch.randn(4, 4, generator=g), "b": torch.zeros(4)},
            "optimizer": {"state": {0: {"step": torch.tensor(float(step))}}, "param_groups": []},
            "step": step}


def _save(tier, step, world_size=1):
    for rank in range(world_size):
        tier.save_rank(step, rank, world_size, _state(step, rank), meta={"rank": rank})
    tier.commit(step, world_size, meta={"note": f"step {step}"})


def _rank_file(root, step, rank=0):
    return root / f"step_{step:08d}" / f"rank_{rank:05d}.safetensors"


def test_save_commit_load(tmp_path):
    tier = StorageTier(tmp_path, keep=3)
    info = tier.save_rank(10, 0, 2, _state(10, 0), meta={"epoch": 1})
    assert info["file"] == "rank_00000.safetensors" and info["bytes"] > 0
    tier.save_rank(10, 1, 2, _state(10, 1))
    tier.commit(10, 2, meta={"loss": 1.5})
    assert tier.committed_steps() == [10] and tier.latest_step() == 10
    assert (tmp_path / "latest").read_text() == "step_00000010"
    manifest = json.loads((tmp_path / "step_00000010" / MANIFEST).read_text())
    assert manifest["format"] == "unbroken-checkpoint" and manifest["meta"] == {"loss": 1.5}
    state, meta = tier.load_rank(10, 1)
    assert meta == {} and tier.load_rank(10, 0)[1] == {"epoch": 1}
    assert torch.equal(state["model"]["w"], _state(10, 1)["model"]["w"])
    assert list(state["optimizer"]["state"]) == [0]
    assert tier.verify_step(10) == []
    assert describe(tmp_path) == [{"step": 10, "committed": True, "world_size": 2,
                                   "ranks": [0, 1], "bytes": describe(tmp_path)[0]["bytes"]}]


def test_commit_names_missing_rank_file(tmp_path):
    tier = StorageTier(tmp_path)
    tier.save_rank(10, 0, 2, _state(10))
    with pytest.raises(CheckpointError, match=r"rank_00001\.json"):
        tier.commit(10, 2)
    assert not (tmp_path / "step_00000010" / MANIFEST).exists()
    _rank_file(tmp_path, 10).write_bytes(b"short")  # record exists, size does not match
    tier.save_rank(10, 1, 2, _state(10, 1))
    with pytest.raises(CheckpointError, match=r"rank_00000\.safetensors is 5 bytes"):
        tier.commit(10, 2)


def test_uncommitted_step_is_skipped(tmp_path, caplog):
    tier = StorageTier(tmp_path)
    _save(tier, 10)
    tier.save_rank(20, 0, 1, _state(20))  # crashed before commit
    assert tier.committed_steps() == [10] and tier.latest_step() == 10
    with caplog.at_level(logging.WARNING):
        assert tier.newest_loadable_step(0) == 10
    assert caplog.records == []
    with pytest.raises(CheckpointCorrupt, match="missing"):
        tier.load_rank(20, 0)
    assert describe(tmp_path)[0] == {"step": 20, "committed": False, "world_size": 1,
                                     "ranks": [0], "bytes": describe(tmp_path)[0]["bytes"]}


def test_corrupted_byte_is_detected_and_skipped(tmp_path, caplog):
    tier = StorageTier(tmp_path)
    _save(tier, 10)
    _save(tier, 20)
    path = _rank_file(tmp_path, 20)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40  # inside the tensor data, not the header
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match="crc32 mismatch: expected") as exc:
        tier.verify_rank(20, 0)
    assert str(path) in str(exc.value)
    with pytest.raises(CheckpointCorrupt, match="crc32 mismatch"):
        tier.load_rank(20, 0)
    with caplog.at_level(logging.WARNING, logger="unbroken.checkpoint.storage"):
        assert tier.newest_loadable_step(0) == 10
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0].getMessage()
    assert tier.newest_loadable_step(0, at_or_below=15) == 10
    assert tier.newest_loadable_step(0, at_or_below=5) is None
    assert len(tier.verify_step(20)) == 1


def test_truncated_file_is_detected_and_skipped(tmp_path, caplog):
    tier = StorageTier(tmp_path)
    _save(tier, 10)
    _save(tier, 20)
    path = _rank_file(tmp_path, 20)
    full = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(full - 10)
    with pytest.raises(CheckpointCorrupt, match=f"truncated: expected {full} bytes, found {full - 10}"):
        tier.verify_rank(20, 0)
    with caplog.at_level(logging.WARNING, logger="unbroken.checkpoint.storage"):
        assert tier.newest_loadable_step(0) == 10
    assert len(caplog.records) == 1 and str(path) in caplog.records[0].getMessage()
    path.unlink()
    with pytest.raises(CheckpointCorrupt, match="missing"):
        tier.verify_rank(20, 0)


def test_foreign_manifest_and_record(tmp_path, caplog):
    tier = StorageTier(tmp_path)
    _save(tier, 10)
    _save(tier, 20)
    manifest = tmp_path / "step_00000020" / MANIFEST
    manifest.write_text(json.dumps({"format": "other-tool", "version": 1}))
    with pytest.raises(CheckpointCorrupt, match="not an unbroken checkpoint .format 'other-tool'") as exc:
        tier.verify_rank(20, 0)
    assert str(manifest) in str(exc.value)
    assert tier.committed_steps() == [10] and tier.latest_step() == 10
    with caplog.at_level(logging.WARNING, logger="unbroken.checkpoint.storage"):
        assert tier.newest_loadable_step(0) == 10
    assert len(caplog.records) == 1
    record = tmp_path / "step_00000010" / "rank_00000.json"
    record.write_text("[1, 2")
    with pytest.raises(CheckpointCorrupt, match=r"rank_00000\.json: unreadable"):
        tier.load_rank(10, 0)
    with pytest.raises(CheckpointCorrupt, match="no rank 3"):
        tier.verify_rank(10, 3)


def test_retention_keeps_newest_and_leaves_other_files(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "step_foo").mkdir()
    (tmp_path / "step_0000001").mkdir()  # not our naming
    user_step = tmp_path / "step_00000005"
    user_step.mkdir()
    (user_step / "mine.txt").write_text("do not delete")
    tier = StorageTier(tmp_path, keep=2)
    tier.save_rank(15, 0, 1, _state(15))  # incomplete, older than the newest commit
    tier.save_rank(99, 0, 1, _state(99))  # incomplete, newer: a save in progress
    for step in (10, 20, 30, 40):
        _save(tier, step)
    assert tier.committed_steps() == [40, 30]
    names = {p.name for p in tmp_path.iterdir()}
    assert names == {"latest", "notes.txt", "step_00000005", "step_00000030", "step_00000040",
                     "step_00000099", "step_0000001", "step_foo"}
    assert (user_step / "mine.txt").read_text() == "do not delete"
    assert tier.newest_loadable_step(0) == 40


def test_file_and_dir_modes(tmp_path):
    old_umask = os.umask(0)
    try:
        tier = StorageTier(tmp_path / "ckpt")
        _save(tier, 10)
    finally:
        os.umask(old_umask)
    root = tmp_path / "ckpt"
    for path in [root, root / "step_00000010"]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    for path in [root / "latest", *(root / "step_00000010").iterdir()]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_disk_full_keeps_previous_checkpoint(tmp_path, monkeypatch):
    tier = StorageTier(tmp_path)
    _save(tier, 10)

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", no_space)
        with pytest.raises(CheckpointError, match="No space left on device.*not committed"):
            tier.save_rank(20, 0, 1, _state(20))
    step_dir = tmp_path / "step_00000020"
    assert not step_dir.exists() or list(step_dir.iterdir()) == []  # no tmp files left
    with pytest.raises(CheckpointError, match=r"rank_00000\.json"):
        tier.commit(20, 1)

    tier.save_rank(20, 0, 1, _state(20))  # rank files fine, the manifest write fails
    with monkeypatch.context() as m:
        m.setattr(os, "fsync", no_space)
        with pytest.raises(CheckpointError, match="No space left"):
            tier.commit(20, 1)
    assert not (step_dir / MANIFEST).exists()
    assert [p.name for p in step_dir.iterdir() if ".tmp" in p.name] == []
    assert tier.latest_step() == 10 and tier.newest_loadable_step(0) == 10
    state, _ = tier.load_rank(10, 0)
    assert torch.equal(state["model"]["w"], _state(10)["model"]["w"])


def test_resave_of_committed_step_uncommits_it_first(tmp_path):
    tier = StorageTier(tmp_path)
    _save(tier, 10)
    tier.save_rank(10, 0, 1, _state(11))
    assert tier.committed_steps() == []
    tier.commit(10, 1)
    assert torch.equal(tier.load_rank(10, 0)[0]["model"]["w"], _state(11)["model"]["w"])


def test_bad_arguments(tmp_path):
    with pytest.raises(ConfigError, match="keep"):
        StorageTier(tmp_path, keep=0)
    tier = StorageTier(tmp_path)
    with pytest.raises(ConfigError, match="rank 2 is out of range"):
        tier.save_rank(1, 2, 2, {})
    with pytest.raises(CheckpointError, match="not JSON-serializable"):
        tier.save_rank(1, 0, 1, {}, meta={"x": object()})


def test_loadable_steps_lists_a_ranks_committed_steps_without_reading_data(tmp_path, caplog):
    tier = StorageTier(tmp_path, keep=5)
    for step in (10, 20, 30):
        _save(tier, step, world_size=2)
    tier.save_rank(40, 0, 2, _state(40))  # never committed: not listed, no warning
    rotted = _rank_file(tmp_path, 30, rank=1)
    data = bytearray(rotted.read_bytes())
    data[-3] ^= 0x40  # same size: listed here, its crc32 fails at load
    rotted.write_bytes(bytes(data))
    truncated = _rank_file(tmp_path, 20, rank=1)
    truncated.write_bytes(truncated.read_bytes()[:-10])
    with caplog.at_level(logging.WARNING, logger="unbroken.checkpoint.storage"):
        assert tier.loadable_steps(0) == [30, 20, 10]
        assert caplog.records == []
        assert tier.loadable_steps(1) == [30, 10]
    assert len(caplog.records) == 1 and str(truncated) in caplog.records[0].getMessage()
    assert tier.loadable_steps(1, at_or_below=29) == [10]
    assert tier.loadable_steps(0, at_or_below=5) == []
    with pytest.raises(CheckpointCorrupt, match="crc32 mismatch"):
        tier.load_rank(30, 1)
