"""A tracked StatefulDataLoader: the iterator the script holds follows every state load, and the
epoch of its DistributedSampler is state (no processes: the loads a rollback, a replacement and a
restart make, called as the session calls them)."""

from __future__ import annotations

import gc

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from unbroken.errors import ConfigError
from unbroken.worker.api import SessionHooks
from unbroken.worker.tracked import TrackedState

HOOKS = SessionHooks(on_phase=lambda name, step: None, should_abort=lambda: False, defer_completion=False)
SAMPLES, BATCH = 24, 4  # 2 ranks: 3 batches per epoch and rank
EPOCH_KEY = "unbroken_sampler_epoch"  # unbroken.worker.loaders.EPOCH_KEY (a literal: the state format is fixed)


def _loader(num_workers: int = 0, persistent: bool = False) -> tuple[StatefulDataLoader, DistributedSampler]:
    dataset = TensorDataset(torch.arange(SAMPLES))
    sampler = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=5)
    return StatefulDataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=num_workers,
                              persistent_workers=persistent), sampler


class Script:
    """The exact loop's data side: ``it = iter(loader)`` once, a new iterator at each rollover, the
    epoch left to unbroken (``counter``: the usual torch loop's ``set_epoch`` from a script variable)."""

    def __init__(self, num_workers: int = 0, counter: bool = False, persistent: bool = False) -> None:
        self.loader, self.sampler = _loader(num_workers, persistent)
        self.tracked = TrackedState()
        self.tracked.add("loader", self.loader, HOOKS)
        self.counter = 0 if counter else None
        if self.counter is not None:
            self.sampler.set_epoch(self.counter)
        self.it = iter(self.loader)

    def batch(self) -> list[int]:
        try:
            (x,) = next(self.it)
        except StopIteration:
            if self.counter is not None:
                self.counter += 1
                self.sampler.set_epoch(self.counter)
            self.it = iter(self.loader)
            (x,) = next(self.it)
        return x.tolist()

    def batches(self, count: int) -> list[list[int]]:
        return [self.batch() for _ in range(count)]


def _fault_free(total: int, at: int, **kw) -> tuple[list[list[int]], dict, dict]:
    """(every batch, the per-rank state and checkpoint tree at batch ``at``) of a run without faults."""
    script = Script(**kw)
    seen = script.batches(at)
    per_rank, tree = script.tracked.per_rank_tree(), script.tracked.tree()
    return seen + script.batches(total - at), per_rank, tree


def test_each_pass_reshuffles_as_set_epoch_would():
    loader, sampler = _loader()
    by_hand = []
    for epoch in range(3):  # the stock loop, untracked
        sampler.set_epoch(epoch)
        by_hand += [x.tolist() for (x,) in loader]
    assert Script().batches(9) == by_hand


@pytest.mark.parametrize("num_workers,persistent", [(0, False), (2, False), (2, True)])
def test_a_replacements_iterator_made_before_its_state_arrives_follows_it(num_workers, persistent):
    want, per_rank, _ = _fault_free(14, 7, num_workers=num_workers, persistent=persistent)  # epoch 2, mid-epoch
    assert per_rank["objects"]["loader"][EPOCH_KEY] == 2
    replacement = Script(num_workers=num_workers, persistent=persistent)  # it = iter(loader) made, at epoch 0
    replacement.tracked.load_per_rank(per_rank)
    assert replacement.sampler.epoch == 2
    assert replacement.batches(7) == want[7:]  # across the rollovers to epochs 3 and 4 too
    del replacement
    gc.collect()  # the loaders' worker processes end with them, before the no-leftovers check


@pytest.mark.parametrize("num_workers,persistent", [(0, False), (2, True)])
def test_a_survivors_rollback_repositions_the_iterator_it_holds_across_a_rollover(num_workers, persistent):
    want = Script().batches(10)
    script = Script(num_workers=num_workers, persistent=persistent)
    script.batches(5)  # batch 5 is the last of epoch 1
    local, per_rank = script.tracked.step_start()
    dropped = script.batches(2)  # the dropped step rolled over: a new iterator, epoch 2
    assert script.sampler.epoch == 2 and dropped == want[5:7]
    script.tracked.load_rollback(local, per_rank)
    assert script.sampler.epoch == 1
    assert script.batches(5) == want[5:]  # the redo: the same batches, the same rollover
    del script
    gc.collect()


def test_a_checkpoint_restores_the_epoch_and_position_and_loads_by_hand_too():
    want, _, tree = _fault_free(9, 4)
    restarted = Script()
    restarted.tracked.load_tree(tree)
    assert restarted.batches(5) == want[4:]
    loader, sampler = _loader()  # untracked: the state is loader.state_dict() plus one key it ignores
    loader.load_state_dict(tree["tracked"]["loader"])
    sampler.set_epoch(tree["tracked"]["loader"][EPOCH_KEY])
    by_hand = [x.tolist() for (x,) in loader]
    sampler.set_epoch(sampler.epoch + 1)
    by_hand += [x.tolist() for (x,) in loader]
    assert by_hand[:5] == want[4:]


def test_an_epoch_set_by_the_script_is_refused_at_its_first_call_in_every_run():
    with pytest.raises(ConfigError, match=r"rank 1: sampler.set_epoch\(0\) on the sampler of a loader given to "
                                          r"job.track.*Remove the set_epoch calls"):
        Script(counter=True)  # before any batch: the usual loop's set_epoch(0) before its first step


def test_a_distributed_sampler_tracked_alone_names_the_loader_to_track():
    sampler = DistributedSampler(TensorDataset(torch.arange(4)), num_replicas=1, rank=0)
    with pytest.raises(ConfigError, match="track the torchdata StatefulDataLoader built on it"):
        TrackedState().add("sampler", sampler, HOOKS)
