"""DataShare (worker/data_share.py): the data-parallel ranks a rank runs, and what it reports against
keeping the global batch exactly on fewer ranks (rung elastic's exact mode). No processes."""

from __future__ import annotations

import random

import torch

from unbroken.worker.data_share import DataShare
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
    torch.rand(1)  # a draw from the global generator inside the step (dropout, say)
    assert "drew from the global random generators" in share.not_exact(MODEL, ())
    share = DataShare(WorkerConfig())
    share.ranks()
    random.random()
    assert "drew from the global random generators" in share.not_exact(MODEL, ())
