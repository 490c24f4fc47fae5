"""examples/train_3d.py's pieces in one process: the head-aware attention split and the layout flags."""

import copy
import pathlib
import sys

import pytest
import torch

_EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def train_3d():
    sys.path.insert(0, str(_EXAMPLES))  # train_3d imports train_gpt as a sibling
    try:
        import train_3d
        yield train_3d
    finally:
        sys.path.remove(str(_EXAMPLES))


def test_split_attention_computes_what_the_fused_attention_computes(train_3d):
    """q, k, v cut out of the fused c_attn (the same weights): the same attention output."""
    torch.manual_seed(0)
    cfg = train_3d.GPTConfig(vocab_size=17, block_size=8, n_layer=1, n_head=4, n_embd=32)
    fused = train_3d.CausalSelfAttention(cfg)
    split = train_3d.SplitAttention(fused)
    x = torch.randn(2, 8, 32)
    torch.testing.assert_close(split(x), fused(x), rtol=1e-5, atol=1e-6)
    q, k, v = fused.c_attn.weight.split(32, dim=0)
    assert torch.equal(split.q.weight, q) and torch.equal(split.k.weight, k) and torch.equal(split.v.weight, v)


def _tp_shard(split, part: int, parts: int = 2):
    """What tp rank ``part`` of ``parts`` holds of a SplitAttention: its rows of q, k, v (whole heads)
    and its columns of c_proj, as ColwiseParallel / RowwiseParallel cut them."""
    shard = copy.deepcopy(split)
    with torch.no_grad():
        for name in ("q", "k", "v"):
            rows = getattr(split, name).weight.chunk(parts, dim=0)[part]
            setattr(shard, name, torch.nn.Linear(rows.size(1), rows.size(0), bias=False))
            getattr(shard, name).weight.copy_(rows)
        cols = split.c_proj.weight.chunk(parts, dim=1)[part]
        shard.c_proj = torch.nn.Linear(cols.size(1), cols.size(0), bias=False)
        shard.c_proj.weight.copy_(cols)
    return shard


def test_split_attention_on_a_tp_shard_attends_over_its_own_heads(train_3d):
    """Each tp rank's output is a partial sum of the output projection over its heads; the all-reduce
    (here: the sum) of the two ranks' partials is the whole attention's output."""
    torch.manual_seed(0)
    cfg = train_3d.GPTConfig(vocab_size=17, block_size=8, n_layer=1, n_head=4, n_embd=32)
    split = train_3d.SplitAttention(train_3d.CausalSelfAttention(cfg))
    x = torch.randn(2, 8, 32)
    partials = [_tp_shard(split, part)(x) for part in range(2)]
    torch.testing.assert_close(partials[0] + partials[1], split(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("argv,message", [
    (["--tp", "0"], "--tp 0"),
    (["--tp", "3"], "--tp 3 must divide --n-head 2"),
])
def test_bad_tp_flags_are_usage_errors(train_3d, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        train_3d.parse(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
