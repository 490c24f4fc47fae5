"""Tooling functions: ls, show, verify, export (files load with standard tools)."""

import pytest
import safetensors.torch
import torch
from torch import nn

from unbroken.checkpoint import tools
from unbroken.checkpoint.storage import StorageTier
from unbroken.errors import CheckpointError, ConfigError, NoCheckpoint


def _tied_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight
    return model


def _make(tmp_path, steps=(10, 20)):
    tier = StorageTier(tmp_path, keep=5)
    model = _tied_model()
    for step in steps:
        for rank in range(2):
            state = {"model": model.state_dict(), "step": step,
                     "rng": torch.get_rng_state()}
            tier.save_rank(step, rank, 2, state, meta={"rank": rank})
        tier.commit(step, 2, meta={"step": step})
    return tier, model


def test_list_and_show(tmp_path):
    _make(tmp_path)
    tier = StorageTier(tmp_path)
    tier.save_rank(30, 0, 2, {"x": torch.ones(1)})
    rows = tools.list_steps(tmp_path)
    assert [(r["step"], r["committed"], r["latest"]) for r in rows] == [
        (30, False, False), (20, True, True), (10, True, False)]
    info = tools.show_step(tmp_path)
    assert info["step"] == 20 and info["world_size"] == 2 and info["meta"] == {"step": 20}
    rank1 = info["ranks"][1]
    assert rank1["meta"] == {"rank": 1}
    table = {t["name"]: t for t in rank1["tensors"]}
    assert table["model/0.weight"] == {"name": "model/0.weight", "dtype": "F32",
                                       "shape": [5, 3], "bytes": 60}
    assert table["rng"]["dtype"] == "U8"
    assert tools.show_step(tmp_path, step=10)["step"] == 10


def test_verify(tmp_path):
    assert tools.verify(tmp_path / "nope") != []
    assert "no committed checkpoint" in tools.verify(tmp_path)[0]
    _make(tmp_path)
    assert tools.verify(tmp_path) == []
    path = tmp_path / "step_00000010" / "rank_00001.safetensors"
    path.write_bytes(path.read_bytes()[:-1])
    problems = tools.verify(tmp_path)
    assert len(problems) == 1 and str(path) in problems[0] and "truncated" in problems[0]
    assert tools.verify(tmp_path, step=20) == []
    assert "not committed" in tools.verify(tmp_path, step=99)[0]


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_export_loads_with_standard_tools(tmp_path, fmt):
    _, model = _make(tmp_path / "ckpt")
    out = tmp_path / f"model.{fmt}"
    result = tools.export(tmp_path / "ckpt", out, fmt=fmt, rank=1)
    assert result["step"] == 20 and result["tensors"] == 2
    if fmt == "safetensors":
        loaded = safetensors.torch.load_file(out)
    else:
        loaded = torch.load(out, weights_only=True)
    fresh = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    fresh.load_state_dict(loaded)
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value)
    assert [p.name for p in tmp_path.iterdir() if ".tmp" in p.name] == []


def test_export_errors(tmp_path):
    with pytest.raises(NoCheckpoint):
        tools.export(tmp_path, tmp_path / "x.safetensors")
    _make(tmp_path / "ckpt")
    with pytest.raises(ConfigError, match="format"):
        tools.export(tmp_path / "ckpt", tmp_path / "x", fmt="pickle")
    with pytest.raises(CheckpointError, match="no 'optimizer' entry"):
        tools.export(tmp_path / "ckpt", tmp_path / "x", subtree="optimizer")
    with pytest.raises(CheckpointError, match="not a state dict"):
        tools.export(tmp_path / "ckpt", tmp_path / "x", subtree="step")
