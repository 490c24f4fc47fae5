"""StorageTier on an fsspec URL (the built-in `memory://` filesystem stands in for s3/gs)."""

import logging
import os
import threading
import uuid

import fsspec
import pytest
from fsspec.registry import known_implementations
import torch

from unbroken.checkpoint import tools
from unbroken.checkpoint.storage import StorageTier, describe
from unbroken.errors import ConfigError


@pytest.fixture
def url():
    """A fresh memory:// checkpoint location, removed after the test."""
    path = f"/unbroken-test-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    try:
        yield f"memory://{path.lstrip('/')}/ckpt"
    finally:
        if fs.exists(path):
            fs.rm(path, recursive=True)


def _state(step: int, rank: int) -> dict:
    gen = torch.Generator().manual_seed(step * 10 + rank)
    return {"tracked": {"model": {"w": torch.randn(4, 3, generator=gen),
                                  "b": torch.randn(3, generator=gen).to(torch.bfloat16)}},
            "step": step}


def _save(tier: StorageTier, step: int, world_size: int = 2) -> None:
    for rank in range(world_size):
        tier.save_rank(step, rank, world_size, _state(step, rank), meta={"rank": rank})
    tier.commit(step, world_size, meta={"step": step})


def _fs_path(url: str) -> str:
    return fsspec.core.url_to_fs(url)[1]


@pytest.mark.timeout(60)
def test_save_commit_load_bit_exact(url):
    tier = StorageTier(url, keep=5)
    _save(tier, 10)
    _save(tier, 20)
    assert tier.committed_steps() == [20, 10] and tier.latest_step() == 20
    fs = fsspec.filesystem("memory")
    assert fs.cat_file(_fs_path(url) + "/latest") == b"step_00000020"
    for step in (10, 20):
        for rank in range(2):
            state, meta = tier.load_rank(step, rank)
            expected = _state(step, rank)["tracked"]["model"]
            for name, tensor in expected.items():
                got = state["tracked"]["model"][name]
                assert got.dtype == tensor.dtype and torch.equal(got, tensor)
            assert state["step"] == step and meta == {"rank": rank}
    assert tier.verify_step(20) == []
    rows = describe(url)
    assert [(r["step"], r["committed"], r["world_size"], r["ranks"]) for r in rows] == [
        (20, True, 2, [0, 1]), (10, True, 2, [0, 1])]
    assert all(r["bytes"] > 0 for r in rows)
    # no temporary objects are left behind
    names = [n for d in fs.find(_fs_path(url)) for n in [d.rsplit("/", 1)[-1]]]
    assert not [n for n in names if ".tmp-" in n]


@pytest.mark.timeout(60)
def test_retention_and_latest(url):
    tier = StorageTier(url, keep=2)
    for step in (10, 20, 30):
        _save(tier, step)
    assert tier.committed_steps() == [30, 20]
    fs = fsspec.filesystem("memory")
    assert not fs.exists(_fs_path(url) + "/step_00000010")
    assert tier.latest_step() == 30
    # `latest` pointing at an uncommitted step falls back to the newest committed one
    fs.pipe_file(_fs_path(url) + "/latest", b"step_00000099")
    assert tier.latest_step() == 30


@pytest.mark.timeout(60)
def test_corrupt_object_is_skipped_with_warning(url, caplog):
    tier = StorageTier(url, keep=5)
    _save(tier, 10)
    _save(tier, 20)
    fs = fsspec.filesystem("memory")
    bad = _fs_path(url) + "/step_00000020/rank_00001.safetensors"
    data = bytearray(fs.cat_file(bad))
    data[-1] ^= 0xFF  # same size, different bytes: only the crc32 catches it
    fs.pipe_file(bad, bytes(data))
    with caplog.at_level(logging.WARNING, logger="unbroken.checkpoint.storage"):
        assert tier.newest_loadable_step(rank=1) == 10
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1
    assert f"{url}/step_00000020/rank_00001.safetensors" in warned[0]
    assert "crc32 mismatch" in warned[0]
    assert tier.newest_loadable_step(rank=0) == 20  # rank 0's object is fine

    problems = tools.verify(url)
    assert len(problems) == 1 and "rank_00001.safetensors" in problems[0]
    assert "crc32 mismatch" in problems[0]
    assert tools.verify(url, step=10) == []


@pytest.mark.timeout(60)
def test_uncommitted_step_is_skipped(url, caplog):
    tier = StorageTier(url, keep=5)
    _save(tier, 10)
    for rank in range(2):  # both ranks saved, but never committed: no MANIFEST.json
        tier.save_rank(20, rank, 2, _state(20, rank))
    assert tier.committed_steps() == [10] and tier.latest_step() == 10
    with caplog.at_level(logging.WARNING, logger="unbroken.checkpoint.storage"):
        assert tier.newest_loadable_step(rank=0) == 10
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    rows = tools.list_steps(url)
    assert [(r["step"], r["committed"], r["latest"]) for r in rows] == [
        (20, False, False), (10, True, True)]
    assert tools.verify(url) == []


@pytest.mark.timeout(60)
def test_tools_show_and_export_from_url(url, tmp_path):
    tier = StorageTier(url)
    _save(tier, 10)
    info = tools.show_step(url)
    assert info["step"] == 10 and info["ranks"][0]["file"].startswith(url)
    assert {t["name"] for t in info["ranks"][0]["tensors"]} == {
        "tracked/model/w", "tracked/model/b"}
    out = tools.export(url, tmp_path / "w.safetensors")
    assert out["step"] == 10 and out["tensors"] == 2
    assert "no such checkpoint directory" in tools.verify(url + "-missing")[0]


@pytest.mark.timeout(60)
def test_tier_from_a_second_thread(url):
    """The agent's persister thread builds and uses its own StorageTier on the URL."""
    errors, steps = [], []

    def persist():
        try:
            tier = StorageTier(url)
            _save(tier, 7)
            steps.append(tier.latest_step())
        except BaseException as exc:  # surfaced in the main thread below
            errors.append(exc)

    thread = threading.Thread(target=persist)
    thread.start()
    thread.join(30)
    assert not thread.is_alive() and not errors, errors
    assert steps == [7]
    state, _ = StorageTier(url).load_rank(7, 1)  # the main thread sees the same store
    assert torch.equal(state["tracked"]["model"]["w"], _state(7, 1)["tracked"]["model"]["w"])


@pytest.mark.timeout(60)
def test_file_url_is_the_local_backend(tmp_path):
    tier = StorageTier(f"file://{tmp_path}/ckpt")
    _save(tier, 10)
    step_dir = tmp_path / "ckpt" / "step_00000010"
    assert tier.root == tmp_path / "ckpt"
    assert (step_dir / "MANIFEST.json").is_file()
    assert os.stat(step_dir).st_mode & 0o777 == 0o700
    assert os.stat(step_dir / "rank_00000.safetensors").st_mode & 0o777 == 0o600
    assert StorageTier(tmp_path / "ckpt").latest_step() == 10


@pytest.mark.timeout(60)
def test_unknown_protocol_is_a_config_error():
    with pytest.raises(ConfigError) as info:
        StorageTier("nosuchproto://bucket/ckpt")
    assert "nosuchproto://bucket/ckpt" in str(info.value) and "plugin" in str(info.value)
    fake = "unbrokenfake"  # a protocol fsspec knows, whose plugin package is not installed
    known_implementations[fake] = {"class": "unbrokenfakefs.FakeFileSystem",
                                   "err": "Install unbrokenfakefs"}
    try:
        with pytest.raises(ConfigError) as info:
            StorageTier(f"{fake}://bucket/ckpt")
    finally:
        del known_implementations[fake]
    assert f"{fake}://bucket/ckpt" in str(info.value) and "unbrokenfakefs" in str(info.value)
