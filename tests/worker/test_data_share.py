"""DataShare (worker/data_share.py): the data-parallel ranks a rank runs, and what it reports against
keeping the global batch exactly on fewer ranks (rung elastic's exact mode). No processes."""

from __future__ import annotations

import random

import torch

from unbroken.worker.data_share import DataShare, sum_in_data_rank_order
from unbroken.worker_config import WorkerConfig, worker_config_from_env

MODEL = {"model": torch.nn.Linear(2, 2)}


def test_a_rank_runs_its_own_shard_until_the_job_shrinks():
    share = DataShare(WorkerConfig(rank=1, world_size=3))
    assert share.ranks() == (1,) and share.world_size == 3
    cfg = worker_config_from_env({"RANK": "0", "WORLD_SIZE": "2", "UNBROKEN_DATA_RANKS": "0,2",
                                  "UNBROKEN_DATA_WORLD_SIZE": "3"})
    assert DataShare(cfg).ranks() == (0, 2) and DataShare(cfg).world_size == 3


def test_what_it_reports_against_exact_mode():
    share = DataShare(WorkerConfig())
    assert "never called job.data_ranks()" in share.not_exact(MODEL, ())
    share.ranks()
    assert share.not_exact(MODEL, ()) == ""  # the model, a pure batch of (step, data rank): exact
    assert "tracked objects ['loader'] are per rank" in share.not_exact(MODEL, ["loader"])
    bn = {"net": torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))}
    assert "['net'] keep normalization running statistics" in share.not_exact(bn, ())
    counting = torch.nn.Module()  # (a Linear would draw its init from the global generator)
    counting.register_buffer("seen", torch.zeros(()))
    assert "['net'] keep buffers in their state_dict" in share.not_exact({"net": counting}, ())
    counting.register_buffer("seen", torch.zeros(()), persistent=False)  # not state: exact
    assert "buffers" not in share.not_exact({"net": counting}, ())
    torch.rand(1)  # a draw from the global generator inside the step (dropout, say)
    assert "drew from the global random generators" in share.not_exact(MODEL, ())
    share = DataShare(WorkerConfig())
    share.ranks()
    random.random()
    assert "drew from the global random generators" in share.not_exact(MODEL, ())


def test_the_ordered_sum_has_the_same_bits_at_any_world_size():
    """Three data ranks' parts summed on 3 ranks (one each) and on 2 ranks (0 and 1 on one, 2 on the other)
    give the same bits: the additions run in data-rank order either way."""
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(1000, generator=gen) * 10 ** k for k in (0, 3, -3)]
    three = _sum_on(parts, [[0], [1], [2]])
    assert torch.equal(three, _sum_on(parts, [[0, 1], [2]]))
    assert torch.equal(three, _sum_on(parts, [[0, 1, 2]]))
    assert not torch.equal(parts[0] + (parts[1] + parts[2]), three)  # another order: other bits (the point)


def _sum_on(parts, holdings):
    """sum_in_data_rank_order on rank 0 of a job whose ranks hold ``holdings``, the all-gathers faked by
    packing every rank's rows the way the function does."""
    import math as _math
    rows = _math.ceil(3 / len(holdings))
    indexes, stacks = [], []
    for mine in holdings:
        index = torch.full((rows,), -1, dtype=torch.int64)
        stack = torch.zeros((rows, parts[0].numel()))
        for row, d in enumerate(mine):
            index[row], stack[row] = d, parts[d]
        indexes.append(index)
        stacks.append(stack)
    rounds = iter([indexes, stacks])
    return sum_in_data_rank_order({d: parts[d] for d in holdings[0]}, 3, len(holdings), lambda _: next(rounds))
