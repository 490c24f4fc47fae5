"""`ckpt export --format dcp`: a torch.distributed.checkpoint directory, read by dcp.load."""

import random
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from unbroken.checkpoint import tools
from unbroken.checkpoint.storage import StorageTier
from unbroken.errors import ConfigError


def _checkpoint(root, steps=(10, 20)) -> dict[int, dict]:
    """Steps laid out like the worker session's `_state()`: tracked objects + rng.
    Returns {step: copy of the model's state dict saved at that step}."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    tier = StorageTier(root)
    saved = {}
    for step in steps:
        with torch.no_grad():
            model.weight.add_(1.0)  # each step has different weights
        for rank in range(2):
            state = {"tracked": {"model": model.state_dict()},
                     "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}
            tier.save_rank(step, rank, 2, state)
        tier.commit(step, 2)
        saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return saved


def _dcp_load(path) -> dict:
    fresh = nn.Linear(4, 3).state_dict()
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(fresh, checkpoint_id=path, no_dist=True)
    return fresh


@pytest.mark.timeout(60)
def test_export_dcp_loads_bit_exact(tmp_path):
    saved = _checkpoint(tmp_path / "ckpt")
    out = tmp_path / "dcp"
    info = tools.export(tmp_path / "ckpt", out, fmt="dcp")
    assert info["step"] == 20 and info["tensors"] == 2 and info["bytes"] > 0
    assert (out / ".metadata").is_file()
    loaded = _dcp_load(out)
    expected = saved[20]
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor)
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []

    # an older step, into an existing empty directory
    empty = tmp_path / "empty"
    empty.mkdir()
    tools.export(tmp_path / "ckpt", empty, step=10, fmt="dcp")
    older = _dcp_load(empty)
    assert all(torch.equal(older[k], saved[10][k]) for k in saved[10])
    assert not torch.equal(older["weight"], expected["weight"])


@pytest.mark.timeout(60)
def test_export_dcp_never_overwrites(tmp_path):
    _checkpoint(tmp_path / "ckpt", steps=(10,))
    out = tmp_path / "user_dir"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not an empty directory"):
        tools.export(tmp_path / "ckpt", out, fmt="dcp")
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    with pytest.raises(ConfigError):
        tools.export(tmp_path / "ckpt", a_file, fmt="dcp")
    assert a_file.read_text() == "mine"


@pytest.mark.timeout(120)
def test_cli_export_dcp(tmp_path):
    saved = _checkpoint(tmp_path / "ckpt")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "unbroken.cli.main", "ckpt", "export", str(tmp_path / "ckpt"),
           "--format", "dcp", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "exported step 20" in done.stdout
    assert torch.equal(_dcp_load(out)["weight"], saved[20]["weight"])
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    assert again.returncode == 2 and "not an empty directory" in again.stderr
