"""The transfer first: survivors in no move wait for the movers before building their group.

After a regroup order every rank builds the generation's process group, but only the ranks in
a move of the transfer plan (each piece's sender and its receiver: a few ranks, whatever the
world size) are on the recovery's critical path. When the others build their groups at the
same time, N - 1 processes want the CPU at once and the movers wait for it (docs/scale.md: at
32 ranks on 2 cores the three senders waited 0.1-0.2 s for the replacement to get a core). So a
survivor in no move first waits, blocked in the store and using no CPU, until every mover has
said it is done (:func:`mark_done`, one key per mover and generation), then builds its group.

The wait is only an ordering, never a condition of correctness: it ends on an abort order for a
later generation (the caller gives up this generation), at ``timeout_s``, or on a store error,
and the caller then goes on as it would have without it.

Runs in the training thread of one rank, on the attempt's store (keys ``moved/gen<g>/<rank>``
under the attempt's prefix: the control plane's store, served by the controller).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from datetime import timedelta

import torch.distributed as dist

from unbroken.errors import CollectiveAborted

log = logging.getLogger(__name__)

#: How long one blocked store wait lasts before the abort order is checked again.
POLL_S = 0.2


def _key(gen: int, rank: int) -> str:
    return f"moved/gen{gen}/{rank}"


def mark_done(store: dist.Store | None, gen: int, rank: int) -> None:
    """A mover's transfer of generation ``gen`` is done (best effort: the waiters time out)."""
    if store is None:
        return
    try:
        store.set(_key(gen, rank), b"1")
    except dist.DistStoreError as exc:
        log.warning("rank %d: could not mark its transfer of generation %d done: %s", rank, gen, exc)


def wait_done(store: dist.Store | None, gen: int, movers: Iterable[int], *,
              aborted: Callable[[], bool], timeout_s: float, poll_s: float = POLL_S) -> None:
    """Block until every rank of ``movers`` marked generation ``gen`` done. CollectiveAborted once
    ``aborted()`` (a later generation's abort order); returns at ``timeout_s`` or on a store error."""
    if store is None:
        return
    keys = [_key(gen, r) for r in movers]
    deadline = time.monotonic() + timeout_s
    while not aborted():
        started = time.monotonic()
        try:
            store.wait(keys, timedelta(seconds=poll_s))
            return
        except dist.DistStoreError as exc:
            now = time.monotonic()
            if now - started < poll_s / 2 or now >= deadline:  # not its timeout: the store failed
                log.debug("waiting for the movers of generation %d: %s; going on", gen, exc)
                return
    raise CollectiveAborted(f"an abort order came while waiting for the transfer of generation {gen}")
