"""Checkpointer.check_capacity: a new launch fails on a full shm dir, a job restart degrades
to storage-only checkpoints (event memory_tier_off). Real files, a full statvfs, milliseconds."""

from __future__ import annotations

import dataclasses
import os
from collections import namedtuple

import pytest
import torch

from unbroken.errors import ShmCapacityError
from unbroken.worker.api import SessionHooks
from unbroken.worker.checkpointing import Checkpointer
from unbroken.worker.tracked import TrackedState
from unbroken.worker_config import ENV_JOB_ID, worker_config_from_env


def _checkpointer(tmp_path, attempt: int, events: list) -> Checkpointer:
    cfg = worker_config_from_env({"TORCHELASTIC_RESTART_COUNT": str(attempt), ENV_JOB_ID: "capjob"},
                                 save_dir=str(tmp_path / "save"), every_steps=1)
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, shm_dir=str(tmp_path)))
    tracked = TrackedState()
    tracked.add("w", torch.zeros(1024), SessionHooks(lambda *a: None, lambda: False, True))
    return Checkpointer(cfg, managed=True, tracked=tracked, injector=None, all_min=lambda v: v,
                        event=lambda name, **fields: events.append((name, fields)), metrics={})


@pytest.fixture
def full_shm(monkeypatch):
    statvfs = namedtuple("statvfs", "f_bavail f_frsize")
    monkeypatch.setattr(os, "statvfs", lambda path: statvfs(0, 1))


def test_a_new_launch_fails_before_training(tmp_path, full_shm):
    events: list = []
    ckpt = _checkpointer(tmp_path, attempt=0, events=events)
    with pytest.raises(ShmCapacityError):
        ckpt.check_capacity(0)
    assert events == []


def test_a_restart_turns_the_memory_tier_off_and_says_so(tmp_path, full_shm):
    events: list = []
    ckpt = _checkpointer(tmp_path, attempt=2, events=events)
    assert ckpt.memory_tier
    ckpt.check_capacity(7)
    assert not ckpt.memory_tier and ckpt.storage is not None
    assert [(name, fields["step"]) for name, fields in events] == [("memory_tier_off", 7)]
