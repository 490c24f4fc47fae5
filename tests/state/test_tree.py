"""The state tree: a real training state (model, AdamW, RNG states) round-trips exactly."""

import json
import math
import random
from collections import OrderedDict

import numpy as np
import pytest
import safetensors.torch
import torch
from torch import nn

from unbroken.state.tree import flatten_state, unflatten_state
from unbroken.errors import CheckpointCorrupt, CheckpointError


class TinyLM(nn.Module):
    """Embedding tied to the output head, a LayerNorm, a BatchNorm buffer and dropout."""

    def __init__(self, vocab=11, dim=8):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.ln = nn.LayerNorm(dim)
        self.bn = nn.BatchNorm1d(dim)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied weights share one storage

    def forward(self, idx):
        return self.head(self.drop(self.bn(self.ln(self.wte(idx)))))


def _train_step(model, opt):
    """One step whose data and dropout depend on python, numpy and torch RNGs."""
    n = random.randint(4, 6)
    noise = float(np.random.rand())
    idx = torch.randint(0, 11, (n,))
    loss = nn.functional.cross_entropy(model(idx), idx) * (1.0 + noise)
    opt.zero_grad()
    loss.backward()
    opt.step()


def _full_state(model, opt, step):
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                "numpy": np.random.get_state()},
        "loop": {"step": step, "loss_scale": math.inf, "best": math.nan, "tag": "run-1"},
    }


def _through_disk(state):
    """What storage does: safetensors bytes and JSON text in between."""
    tensors, spec = flatten_state(state)
    data = safetensors.torch.save(tensors)
    return unflatten_state(safetensors.torch.load(data), json.loads(json.dumps(spec)))


def _assert_same(a, b, path="root"):
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                     and torch.equal(a.nan_to_num(), b.nan_to_num())), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), path
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}/{i}")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, path


def test_training_state_roundtrip_resumes_bit_identically():
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        _train_step(model, opt)
    state = _full_state(model, opt, step=2)
    restored = _through_disk(state)
    _assert_same(state, restored)
    assert restored["model"]._metadata == state["model"]._metadata

    _train_step(model, opt)  # reference: the original process takes step 3
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    torch.manual_seed(123)  # a fresh process with different RNG states and weights
    random.seed(123)
    np.random.seed(123)
    model2 = TinyLM()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    model2.load_state_dict(restored["model"])
    opt2.load_state_dict(restored["optimizer"])
    torch.set_rng_state(restored["rng"]["torch"])
    random.setstate(restored["rng"]["python"])
    np.random.set_state(restored["rng"]["numpy"])
    _train_step(model2, opt2)
    for name, value in model2.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_odd_leaves_roundtrip_exactly():
    base = torch.arange(12, dtype=torch.float32)
    state = {
        0: "int key", "0": "str key", -3: None,
        "floats": [0.1, -0.0, 1e308, math.inf, -math.inf, math.nan, 5e-324],
        "ints": (2**70, -1, True, False),
        "bytes": b"\x00\xffabc", "empty": ([], (), {}),
        "size": torch.Size([2, 3]),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "rng_u8": torch.get_rng_state(),
        "bf16": torch.randn(3, dtype=torch.bfloat16),
        "c128": torch.tensor([1 + 2j, -3j], dtype=torch.complex128),
        "c128_0d": torch.tensor(1 + 1j, dtype=torch.complex128),
        "noncontig": torch.randn(4, 5).t(),
        "view_a": base[:6], "view_b": base[6:],
        "np_scalars": [np.float64(math.nan), np.int32(-4), np.bool_(True)],
        "np_arrays": [np.arange(6, dtype=">u4").reshape(2, 3), np.array(2.5)],
        "ordered": OrderedDict(b=1, a=2),
    }
    restored = _through_disk(state)
    _assert_same(state, restored)
    assert restored["np_arrays"][0].dtype == np.dtype(">u4")


def test_names_are_unique_and_readable():
    w = torch.randn(3)
    tensors, _ = flatten_state({"a/b": w.clone(), "a": {"b": w.clone()}, 1: w.clone(), "1": w.clone()})
    assert len(tensors) == 4
    assert "a/b" in tensors and "1" in tensors


def test_tied_weights_are_stored_once_and_saveable():
    model = TinyLM()
    tensors, _ = flatten_state({"model": model.state_dict()})
    assert "model/wte.weight" in tensors and "model/head.weight" not in tensors
    safetensors.torch.save(tensors)  # would raise on shared storage


def test_unsupported_leaf_names_path_and_type():
    with pytest.raises(CheckpointError, match=r"'opt/state/0/fn'.*builtins\.function"):
        flatten_state({"opt": {"state": {0: {"fn": lambda: 0}}}})
    with pytest.raises(CheckpointError, match=r"key 1\.5 has type float"):
        flatten_state({"x": {1.5: 1}})
    with pytest.raises(CheckpointError, match=r"object"):
        flatten_state({"x": np.array([object()])})


def test_bad_spec_is_corrupt():
    tensors, spec = flatten_state({"w": torch.ones(2)})
    with pytest.raises(CheckpointCorrupt, match="missing"):
        unflatten_state({}, spec)
    with pytest.raises(CheckpointCorrupt, match="not an"):
        unflatten_state(tensors, {"format": "other"})
    spec["root"]["items"][0][1] = {"t": "pickle"}
    with pytest.raises(CheckpointCorrupt, match="unknown node type"):
        unflatten_state(tensors, spec)
