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


class Script:
    """The usual loop's data side: ``it = iter(loader)`` once, ``set_epoch`` + a new iterator at each
    rollover (``counter``: the epoch from a script variable, as many scripts do; else from the sampler)."""

    def __init__(self, num_workers: int = 0, counter: bool = False) -> None:
        dataset = TensorDataset(torch.arange(SAMPLES))
        self.sampler = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=5)
        self.loader = StatefulDataLoader(dataset, batch_size=BATCH, sampler=self.sampler, num_workers=num_workers)
        self.tracked = TrackedState()
        self.tracked.add("loader", self.loader, HOOKS)
        self.counter = 0 if counter else None
        self.sampler.set_epoch(0)
        self.it = iter(self.loader)

    def batch(self) -> list[int]:
        try:
            (x,) = next(self.it)
        except StopIteration:
            if self.counter is not None:
                self.counter += 1
                self.sampler.set_epoch(self.counter)
            else:
                self.sampler.set_epoch(self.sampler.epoch + 1)
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


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_replacements_iterator_made_before_its_state_arrives_follows_it(num_workers):
    want, per_rank, _ = _fault_free(14, 7, num_workers=num_workers)  # batch 7: epoch 2, mid-epoch
    assert per_rank["objects"]["loader"][EPOCH_KEY] == 2
    replacement = Script(num_workers=num_workers)  # it = iter(loader) already made, at epoch 0
    replacement.tracked.load_per_rank(per_rank)
    assert replacement.sampler.epoch == 2
    assert replacement.batches(7) == want[7:]  # across the rollovers to epochs 3 and 4 too
    del replacement
    gc.collect()  # the loaders' worker processes end with them, before the no-leftovers check


def test_a_survivors_rollback_repositions_the_iterator_it_holds_across_a_rollover():
    want = Script().batches(10)
    script = Script()
    script.batches(5)  # batch 5 is the last of epoch 1
    local, per_rank = script.tracked.step_start()
    dropped = script.batches(2)  # the dropped step rolled over: a new iterator, epoch 2
    assert script.sampler.epoch == 2 and dropped == want[5:7]
    script.tracked.load_rollback(local, per_rank)
    assert script.sampler.epoch == 1
    assert script.batches(5) == want[5:]  # the redo: the same batches, the same rollover


def test_a_checkpoint_restores_the_epoch_and_position_and_loads_by_hand_too():
    want, _, tree = _fault_free(9, 4)
    restarted = Script()
    restarted.tracked.load_tree(tree)
    assert restarted.batches(5) == want[4:]
    by_hand = Script()  # the state is loader.state_dict() plus one key load_state_dict ignores
    by_hand.loader.load_state_dict(tree["tracked"]["loader"])
    by_hand.sampler.set_epoch(tree["tracked"]["loader"][EPOCH_KEY])
    by_hand.it = iter(by_hand.loader)
    assert by_hand.batches(5) == want[4:]


def test_an_epoch_counter_the_load_did_not_restore_is_refused_at_the_next_rollover():
    _, per_rank, _ = _fault_free(10, 9, counter=True)  # epoch 2, its last batch taken
    replacement = Script(counter=True)  # its counter starts again at 0
    replacement.tracked.load_per_rank(per_rank)
    with pytest.raises(ConfigError, match=r"set_epoch\(1\) at an epoch rollover after unbroken restored .* to "
                                          r"epoch 2.*sampler.set_epoch\(sampler.epoch \+ 1\)"):
        replacement.batch()


def test_an_epoch_counter_in_step_with_the_loaded_epoch_passes():
    want, per_rank, _ = _fault_free(10, 4, counter=True)
    survivor = Script(counter=True)
    survivor.batches(4)  # its counter is where the fault-free run's was
    survivor.tracked.load_per_rank(per_rank)
    assert survivor.batches(6) == want[4:]


def test_a_distributed_sampler_tracked_alone_names_the_loader_to_track():
    sampler = DistributedSampler(TensorDataset(torch.arange(4)), num_replicas=1, rank=0)
    with pytest.raises(ConfigError, match="track the torchdata StatefulDataLoader built on it"):
        TrackedState().add("sampler", sampler, HOOKS)
