"""The first step's check for state the script changes but did not track (worker/untracked.py), and
torch and numpy generators tracked as they are (worker/tracked.py)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from unbroken.errors import ConfigError
from unbroken.state.blob import decode_tree, encode_tree
from unbroken.worker.api import SessionHooks
from unbroken.worker.tracked import TrackedState
from unbroken.worker.untracked import FirstStepWatch, refuse_changed

HOOKS = SessionHooks(on_phase=lambda *a: None, should_abort=lambda: False, defer_completion=False,
                     fail=lambda exc: None)


class Wrapper(torch.nn.Module):  # what DDP is to the module it wraps
    def __init__(self, inner):
        super().__init__()
        self.module = inner


def _script():
    """A script's loop frame: a tracked model and optimizer, and what it forgot or never changes."""
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    names = dict(net=net, model=Wrapper(net), opt=torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                 ema=torch.nn.Linear(3, 2), teacher=torch.nn.Linear(3, 2), g=torch.Generator().manual_seed(1),
                 tracked_g=torch.Generator().manual_seed(2), rng=np.random.default_rng(3), metric=torch.nn.Linear(1, 1),
                 pyrng=random.Random(4), random_module=random,
                 x=torch.ones(2, 3), steps=8)
    tracked = TrackedState()
    tracked.add("net", net, HOOKS)
    tracked.add("tracked_g", names["tracked_g"], HOOKS)
    return names, tracked


def _step(names, *, forget=()):
    loss = names["model"].module(names["x"] + torch.randn(2, 3, generator=names["g"])).sum()
    loss.backward()
    names["opt"].step()
    with torch.no_grad():
        names["ema"].weight.mul_(0.9)
        names["metric"].weight.add_(1.0)
    torch.rand(1, generator=names["tracked_g"])
    names["rng"].random()
    names["pyrng"].random()
    random.random()  # the global stream: tracked for you, never named

def test_what_the_first_step_changed_and_nothing_tracks_is_named():
    names, tracked = _script()
    tracked.add("opt", names["opt"], HOOKS)
    watch = FirstStepWatch(SimpleNamespace(f_globals={}, f_locals=names), tracked.covered_ids(), not_state=["metric"])
    _step(names)
    assert sorted(watch.changed()) == ["ema (Linear)", "g (Generator)", "pyrng (Random)", "rng (Generator)"]
    with pytest.raises(ConfigError, match=r"the first step changed ema \(Linear\), g .*job.track\(\.\.\., name=obj\)"):
        refuse_changed(sorted(watch.changed()), rank=1)


def test_an_untracked_optimizer_is_named_once_it_stepped():
    names, tracked = _script()
    watch = FirstStepWatch(SimpleNamespace(f_globals=names, f_locals={}), tracked.covered_ids(),
                           not_state=["metric", "ema", "g", "rng", "pyrng"])
    _step(names)
    assert watch.changed() == ["opt (SGD)"]


def test_nothing_changed_nothing_named():
    names, tracked = _script()
    watch = FirstStepWatch(SimpleNamespace(f_globals={}, f_locals=names), tracked.covered_ids(), not_state=())
    assert watch.changed() == [] and FirstStepWatch(None, set(), ()).changed() == []
    refuse_changed([], rank=0)


@pytest.mark.parametrize("make", [lambda: torch.Generator().manual_seed(5), lambda: np.random.default_rng(5),
                                  lambda: random.Random(5),
                                  lambda: np.random.RandomState(5), lambda: np.random.Generator(np.random.MT19937(5))])
def test_a_tracked_generator_rolls_back_through_the_state_tree(make):
    g = make()
    tracked = TrackedState()
    tracked.add("g", g, HOOKS)
    saved = decode_tree(encode_tree(tracked.state_of(tracked.objects["g"])), "a test")
    first = _draw(g)
    tracked.load_one(tracked.objects["g"], saved)
    assert _draw(g) == first


def _draw(g) -> list[float]:
    if isinstance(g, torch.Generator):
        return torch.rand(3, generator=g).tolist()
    if isinstance(g, random.Random):
        return [g.random() for _ in range(3)]
    return list(g.random(3) if hasattr(g, "random") else g.random_sample(3))


class Source:
    """The script's own data source, holding the generator it draws from (``keeps``: in its state_dict)."""

    def __init__(self, g: torch.Generator, keeps: bool) -> None:
        self.g, self.keeps, self.position = g, keeps, 0

    def next(self) -> torch.Tensor:
        self.position += 1
        return torch.randn(2, generator=self.g)

    def state_dict(self) -> dict:
        return {"position": self.position, **({"g": self.g.get_state()} if self.keeps else {})}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]
        if self.keeps:
            self.g.set_state(state["g"])


@pytest.mark.parametrize("keeps", [True, False])
def test_a_generator_a_tracked_source_keeps_in_its_state_is_covered_one_it_does_not_is_named(keeps):
    g = torch.Generator().manual_seed(5)
    source = Source(g, keeps)
    tracked = TrackedState()
    tracked.add("source", source, HOOKS)
    watch = FirstStepWatch(SimpleNamespace(f_globals={}, f_locals=dict(g=g, source=source)), tracked.covered_ids(),
                           not_state=(), tracked=tracked.objects)
    source.next()
    after = g.get_state()
    assert watch.changed() == ([] if keeps else ["g (Generator)"])
    assert torch.equal(g.get_state(), after) and source.position == 1  # the coverage test left both as they were


def test_a_tracked_modules_train_or_eval_mode_is_part_of_its_fingerprint_after_a_reduction():
    """model.eval(), a validation all-reduce after the update, model.train(): a step cut inside that reduction
    would leave the model in eval mode, so the change after it must be seen (worker/step_boundary.py)."""
    from unbroken.worker.untracked import TrackedWatch
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
    tracked = TrackedState()
    tracked.add("model", model, HOOKS)
    model.eval()
    watch = TrackedWatch(tracked.objects)  # armed as the reduction begins
    model.train()
    assert watch.changed() == ["model (Sequential)"]


def test_an_iterator_of_a_loader_nobody_tracks_is_named_a_tracked_loaders_is_not():
    """A second loader the script forgot (its position lost after a fault: a probe found exit 0 with other
    weights); the iterators of a tracked loader, and of one a tracked object holds, are covered."""
    from torchdata.stateful_dataloader import StatefulDataLoader
    dataset = torch.utils.data.TensorDataset(torch.arange(16))
    tracked_loader, held_loader = StatefulDataLoader(dataset, batch_size=2), StatefulDataLoader(dataset, batch_size=2)
    holder = SimpleNamespace(loader=held_loader, state_dict=lambda: {}, load_state_dict=lambda s: None)
    names = dict(it=iter(tracked_loader), held_it=iter(held_loader),
                 aux=iter(torch.utils.data.DataLoader(dataset, batch_size=2, shuffle=True)))
    tracked = TrackedState()
    tracked.add("loader", tracked_loader, HOOKS)
    tracked.add("data", holder, HOOKS)
    watch = FirstStepWatch(SimpleNamespace(f_globals={}, f_locals=names), tracked.covered_ids(), not_state=())
    for it in names.values():
        next(it)
    assert watch.changed() == ["aux (_SingleProcessDataLoaderIter)"]


def test_a_loader_iterator_the_first_step_made_and_left_part_way_is_named():
    """`it = iter(loader)` inside the loop (a hand-written resume: skip k batches), then next(it) each step:
    no fingerprint at the loop's start, a position all the same. Not: a tracked loader's new iterator, nor an
    evaluation's iterator read to its end."""
    from torchdata.stateful_dataloader import StatefulDataLoader
    dataset = torch.utils.data.TensorDataset(torch.arange(16))
    tracked_loader = StatefulDataLoader(dataset, batch_size=2)
    tracked = TrackedState()
    tracked.add("loader", tracked_loader, HOOKS)
    scope: dict = {}
    watch = FirstStepWatch(SimpleNamespace(f_globals={}, f_locals=scope), tracked.covered_ids(), not_state=(),
                           tracked=tracked.objects, covered_now=tracked.covered_ids)
    scope["it"] = iter(torch.utils.data.DataLoader(dataset, batch_size=2))  # the first step makes them
    scope["tracked_it"] = iter(tracked_loader)
    scope["val_it"] = iter(torch.utils.data.DataLoader(dataset, batch_size=8))
    next(scope["it"]), next(scope["tracked_it"]), list(scope["val_it"])
    assert watch.changed() == ["it (_SingleProcessDataLoaderIter)"]
