"""Generation groups with lazy connections (comm/groups.py ``gloo_group(lazy_connect=True)``).

Real gloo, each rank a thread of this process on one HashStore (no store sockets): the TCP
connections the process holds are the groups' pairs, counted with psutil.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import psutil
import pytest
import torch
import torch.distributed as dist

from unbroken.comm.groups import gloo_group

pytestmark = pytest.mark.timeout(60)

WORLD = 4


def _established() -> int:
    return sum(1 for c in psutil.Process(os.getpid()).net_connections(kind="tcp") if c.status == "ESTABLISHED")


def _on_ranks(fn) -> list:
    out: list = [None] * WORLD
    errors: list[BaseException] = []

    def wrap(rank: int) -> None:
        try:
            out[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return out


def _build(store: dist.Store, prefix: str, lazy: bool) -> list[dist.ProcessGroup]:
    return _on_ranks(lambda rank: gloo_group(dist.PrefixStore(prefix, store), rank, WORLD, timedelta(seconds=20),
                                             lazy_connect=lazy))


def test_a_lazy_group_connects_no_pair_at_its_build_and_only_the_pairs_a_collective_uses():
    store = dist.HashStore()
    before = _established()
    eager = _build(store, "eager/", lazy=False)
    full_mesh = _established() - before
    assert full_mesh == WORLD * (WORLD - 1)  # every pair, one socket at each end

    lazy = _build(store, "lazy/", lazy=True)
    assert _established() - before == full_mesh  # built, nothing connected

    sums = _on_ranks(lambda rank: _all_reduce(lazy[rank], rank))
    assert all(torch.equal(s, torch.full((8,), float(sum(range(WORLD))))) for s in sums)  # correct results
    used = _established() - before - full_mesh
    assert used == 2 * WORLD < full_mesh  # a ring: each rank and its two neighbours
    del eager


def _all_reduce(group: dist.ProcessGroup, rank: int) -> torch.Tensor:
    t = torch.full((8,), float(rank))
    group.allreduce([t]).wait()
    return t
