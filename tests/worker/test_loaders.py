"""A tracked StatefulDataLoader: the iterator the script holds follows every state load, and the
epoch of its DistributedSampler is state (no processes: the loads a rollback, a replacement and a
restart make, called as the session calls them)."""

from __future__ import annotations

import gc
from types import SimpleNamespace

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


class Augmenting(torch.utils.data.Dataset):
    """A map-style dataset whose items carry draws from every global stream of the process that
    fetches them (in a loader's worker: that worker's streams), as augmentation does."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[int, float, float, float]:
        import random

        import numpy as np
        return index, torch.rand(()).item(), random.random(), float(np.random.rand())


class CountingAugmenting(Augmenting):
    """Augmenting with its own torchdata state (the items it fetched in this process)."""

    def __init__(self) -> None:
        self.fetched = 0

    def __getitem__(self, index: int) -> tuple[int, float, float, float]:
        self.fetched += 1
        return super().__getitem__(index)

    def state_dict(self) -> dict:
        return {"fetched": self.fetched}

    def load_state_dict(self, state: dict) -> None:
        self.fetched = state["fetched"]


class AugmentingScript:
    """Script's loop over an Augmenting dataset: a batch is its items' (index, draws) rows."""

    def __init__(self, dataset_cls: type, num_workers: int, persistent: bool) -> None:
        dataset = dataset_cls()
        self.sampler = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=5)
        self.loader = StatefulDataLoader(dataset, batch_size=BATCH, sampler=self.sampler, num_workers=num_workers,
                                         persistent_workers=persistent)
        self.tracked = TrackedState()
        self.tracked.add("loader", self.loader, HOOKS)
        self.it = iter(self.loader)

    def batch(self) -> list[list[float]]:
        try:
            columns = next(self.it)
        except StopIteration:
            self.it = iter(self.loader)
            columns = next(self.it)
        return torch.stack([c.double() for c in columns], dim=1).tolist()

    def batches(self, count: int) -> list:
        return [self.batch() for _ in range(count)]


@pytest.mark.parametrize("dataset_cls", [Augmenting, CountingAugmenting])
@pytest.mark.parametrize("persistent", [False, True])
def test_draws_inside_loader_workers_resume_mid_epoch_as_the_fault_free_run_made_them(dataset_cls, persistent):
    """torchdata restores a worker's position, not its random streams: a replacement resuming mid-epoch
    used to draw other augmentations. The streams of each worker are now that worker's state."""
    scripts = [AugmentingScript(dataset_cls, 2, persistent) for _ in range(3)]  # ended in `finally`, pass or fail
    script, replacement, restarted = scripts
    try:
        script.batches(4)  # epoch 1, its first batch: each worker's streams moved
        per_rank, tree = script.tracked.per_rank_tree(), script.tracked.tree()
        want = script.batches(6)  # the rest of epoch 1, and epochs 2 and 3
        local, start = script.tracked.step_start()
        dropped = script.batches(2)
        replacement.tracked.load_per_rank(per_rank)
        assert replacement.batches(6) == want
        restarted.tracked.load_tree(tree)
        assert restarted.batches(6) == want
        script.tracked.load_rollback(local, start)  # a survivor redoes a dropped step
        assert script.batches(2) == dropped
        if dataset_cls is CountingAugmenting:  # the dataset's own worker state travels beside the streams
            snapshots = per_rank["objects"]["loader"]["_snapshot"]["_worker_snapshots"].values()
            assert max(s["dataset_state"]["dataset"]["fetched"] for s in snapshots) >= BATCH
    finally:
        del script, replacement, restarted, scripts
        gc.collect()


class AugmentingStream(torch.utils.data.IterableDataset):
    """An iterable dataset the usual way (``__iter__`` a generator, no state): each worker streams its
    share of the indices with a draw from its torch stream. torchdata replays a restored worker from its
    start (same seed, same draws); unbroken must leave that replay alone."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        for index in range(info.id, SAMPLES, info.num_workers):
            yield index, torch.rand(()).item()


def test_draws_inside_a_stateless_iterable_datasets_workers_replay_exactly():
    def make():
        loader = StatefulDataLoader(AugmentingStream(), batch_size=BATCH, num_workers=2)
        tracked = TrackedState()
        tracked.add("loader", loader, HOOKS)
        return loader, tracked, iter(loader)

    made = [make(), make()]
    try:
        (_, tracked, it), (_, other, it2) = made
        for _ in range(3):
            next(it)
        per_rank = tracked.per_rank_tree()
        want = [torch.stack([c.double() for c in next(it)], 1).tolist() for _ in range(2)]
        other.load_per_rank(per_rank)
        assert [torch.stack([c.double() for c in next(it2)], 1).tolist() for _ in range(2)] == want
    finally:
        del made, it, it2, tracked, other
        gc.collect()


@pytest.mark.parametrize("held", [False, True])
@pytest.mark.parametrize("make_sampler", [
    lambda ds: torch.utils.data.RandomSampler(ds),
    lambda ds: torch.utils.data.RandomSampler(ds, generator=torch.Generator().manual_seed(1)),
    lambda ds: torch.utils.data.BatchSampler(torch.utils.data.SubsetRandomSampler(range(8)), 4, False),
], ids=["random", "random-generator", "batch-of-subset"])
def test_a_loader_on_torchs_stateless_random_sampler_is_refused_at_track(make_sampler, held):
    """torchdata resumes such a sampler by iterating it again: a new order (a probe of unseen scripts:
    exit 0 with other weights). shuffle=True (torchdata's stateful sampler) is the fix."""
    dataset = TensorDataset(torch.arange(SAMPLES))
    sampler = make_sampler(dataset)
    is_batch = isinstance(sampler, torch.utils.data.BatchSampler)
    loader = StatefulDataLoader(dataset, **({"batch_sampler": sampler} if is_batch else {"sampler": sampler}))
    obj = SimpleNamespace(loader=loader, state_dict=lambda: {}, load_state_dict=lambda s: None) if held else loader
    with pytest.raises(ConfigError, match=r"samples with torch's (RandomSampler|BatchSampler|SubsetRandomSampler)"
                                          r".*Use shuffle=True"):
        TrackedState().add("data", obj, HOOKS)
    TrackedState().add("data", StatefulDataLoader(dataset, shuffle=True, generator=torch.Generator()), HOOKS)


class Wrapped:
    """A script's own data object around a StatefulDataLoader, its state the loader's. ``remakes``: its
    load_state_dict drops its iterator (torchdata's way); else it keeps the one it made (right for a
    load before the first batch, the only load plain torchdata makes)."""

    def __init__(self, num_workers: int, remakes: bool) -> None:
        self.loader, self.sampler = _loader(num_workers)
        self.remakes, self.it = remakes, None

    def batch(self) -> list[int]:
        if self.it is None:
            self.it = iter(self.loader)
        try:
            (x,) = next(self.it)
        except StopIteration:
            self.sampler.set_epoch(self.sampler.epoch + 1)
            self.it = iter(self.loader)
            (x,) = next(self.it)
        return x.tolist()

    def state_dict(self) -> dict:
        return {"loader": self.loader.state_dict(), "epoch": self.sampler.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.set_epoch(state["epoch"])
        self.loader.load_state_dict(state["loader"])
        if self.remakes:
            self.it = None


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("remakes", [False, True])
def test_a_survivors_rollback_moves_the_iterator_a_tracked_wrapper_keeps(num_workers, remakes):
    """A probe of unseen scripts: a wrapper that keeps its iterator across its load_state_dict went on from
    the dropped step's position after a rollback (exit 0, other weights)."""
    data = Wrapped(num_workers, remakes)
    tracked = TrackedState()
    tracked.add("data", data, HOOKS)
    try:
        plain = Wrapped(0, True)  # untracked: the plain sequence
        want = [plain.batch() for _ in range(8)]
        assert [data.batch() for _ in range(4)] == want[:4]
        local, per_rank = tracked.step_start()
        assert [data.batch() for _ in range(2)] == want[4:6]  # the dropped step's batches (across a rollover)
        tracked.load_rollback(local, per_rank)
        tracked.step_start()  # the redo's own step-start read, before its first batch
        stream = torch.get_rng_state()
        first = data.batch()
        assert torch.equal(torch.get_rng_state(), stream), "the redo drew from torch's stream where the run did not"
        assert [first] + [data.batch() for _ in range(3)] == want[4:8]
    finally:
        del data, tracked
        gc.collect()
