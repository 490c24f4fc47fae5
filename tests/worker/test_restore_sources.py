"""The resume rule in the worker's restore sources (restore.build_sources): real storage
directories, no processes, milliseconds."""

from __future__ import annotations

import torch

from unbroken.checkpoint.storage import StorageTier
from unbroken.worker import restore
from unbroken.worker.api import SessionHooks
from unbroken.worker.tracked import TrackedState
from unbroken.worker_config import worker_config_from_env


def _tracked(w: torch.Tensor) -> TrackedState:
    tracked = TrackedState()
    tracked.add("w", w, SessionHooks(lambda *a: None, lambda: False, True))
    return tracked


def _commit(tier: StorageTier, step: int, value: float) -> None:
    tier.save_rank(step, 0, 1, _tracked(torch.full((3,), value)).tree(), {"step": step})
    tier.commit(step, 1)


def _dirs(tmp_path):
    """--save holds step 5 of another run and step 3 of this one; --load holds step 2."""
    save, load = tmp_path / "save", tmp_path / "load"
    _commit(StorageTier(save, run_id="another-run"), 5, 5.0)
    own = StorageTier(save, run_id="this-run")
    _commit(own, 3, 3.0)
    _commit(StorageTier(load), 2, 2.0)
    return own, save, load


def _restore(tmp_path, attempt: int) -> tuple[int, torch.Tensor, list[dict]]:
    own, save, load = _dirs(tmp_path)
    cfg = worker_config_from_env({"TORCHELASTIC_RESTART_COUNT": str(attempt)}, save_dir=str(save),
                                 load_dir=str(load))
    src = restore.build_sources(cfg, own_storage=own, control=None, all_min=lambda v: v)
    w = torch.zeros(3)
    tracked = _tracked(w)
    events: list[dict] = []
    step = restore.restore(src, tracked, lambda name, **fields: events.append({"name": name, **fields}))
    return step, w, events


def test_a_new_launch_resumes_only_from_load(tmp_path):
    step, w, events = _restore(tmp_path, attempt=0)
    assert step == 2 and torch.equal(w, torch.full((3,), 2.0))
    assert events[0]["tier"] == "storage" and events[0]["dir"] == str(tmp_path / "load")


def test_a_restart_resumes_from_its_own_steps_never_another_runs(tmp_path):
    step, w, events = _restore(tmp_path, attempt=1)
    assert step == 3 and torch.equal(w, torch.full((3,), 3.0))  # not step 5: another run's
    assert events[0]["dir"] == str(tmp_path / "save")


def test_sources_by_attempt(tmp_path):
    own, save, load = _dirs(tmp_path)
    for attempt, expected in ((0, [False]), (1, [True, False])):
        cfg = worker_config_from_env({"TORCHELASTIC_RESTART_COUNT": str(attempt)}, save_dir=str(save),
                                     load_dir=str(load))
        src = restore.build_sources(cfg, own_storage=own, control=None, all_min=lambda v: v)
        assert [s.own_run_only for s in src.stores] == expected and src.memory is None
