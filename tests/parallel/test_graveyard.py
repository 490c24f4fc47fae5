"""The graveyard at the job's end: an abandoned state exchange whose thread is still inside a call
on an old backend (a send to a replacement lost while restoring, waiting on a lazily connected pair
for its connection) counts as pending, so the job's end never drops that backend under it: dropping
it there blocked the rank for minutes (gloo's loop shutdown joined while the send still waited).
What is still pending at the deadline, and every old lazily connected backend, is kept to the
process's end (pinned), never destroyed at the interpreter's exit."""

from __future__ import annotations

import sys
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from unbroken.comm.p2p import _InThread
from unbroken.parallel.fabric import Fabric
from unbroken.worker.inflight import InFlight

pytestmark = pytest.mark.timeout(30)


def _fabric(name: str, lazy_connect: bool = False) -> Fabric:
    return Fabric(dist.HashStore(), 0, 1, timeout_s=10.0, name=name, lazy_connect=lazy_connect)


def _inflight(fabric: Fabric) -> InFlight:
    """A rank's in-flight state around ``fabric`` only (no controller): what the job's end uses."""
    cfg = SimpleNamespace(rank=0, replacement=False, worker=SimpleNamespace(pg_timeout_s=0.3))
    return InFlight(cfg, device=torch.device("cpu"), control=None, store=None, group=None, tracked=None,
                    injector=None, dump=None, fabric=fabric)


def test_an_exchange_thread_still_running_counts_as_pending():
    fabric = _fabric("graveyard-pending")
    backend, release = object(), threading.Event()
    exchange = _InThread(lambda: release.wait(10))
    fabric.graveyard.extend([backend, exchange])
    assert fabric.prune_graveyard() == 1  # the backend is no work; the exchange is one, not ended
    release.set()
    exchange.wait()
    assert fabric.prune_graveyard() == 0
    assert fabric.graveyard == [backend]  # the ended exchange goes; the backend stays until the teardown


def test_the_job_end_keeps_the_backends_while_an_exchange_runs_on_one():
    fabric = _fabric("graveyard-release")
    release = threading.Event()
    exchange = _InThread(lambda: release.wait(10))
    inflight = _inflight(fabric)
    backend = object()
    fabric.graveyard.extend([backend, exchange])
    refs = sys.getrefcount(backend)
    assert inflight.release_graveyard() is False  # waited its pg timeout; nothing dropped under the thread
    assert len(fabric.graveyard) == 2
    assert sys.getrefcount(backend) == refs + 1  # and pinned: not destroyed at the interpreter's exit either
    release.set()
    exchange.wait()
    assert inflight.release_graveyard() is True and fabric.graveyard == []


def test_old_lazily_connected_backends_are_kept_to_the_process_end():
    """Their teardown could hang in gloo's loop shutdown with nothing pending (seen under load): kept instead."""
    fabric = _fabric("graveyard-lazy", lazy_connect=True)
    inflight = _inflight(fabric)
    backend = object()
    fabric.graveyard.append(backend)
    refs = sys.getrefcount(backend)
    assert inflight.release_graveyard() is True and fabric.graveyard == []
    assert sys.getrefcount(backend) == refs  # the list let go of it, the pin still holds it: not destroyed
