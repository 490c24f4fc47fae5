"""Waiting on collectives without ever blocking past an abort order (DESIGN.md section 6).

Nothing in torch cancels an in-flight gloo op (FACTS.md): a blocked ``work.wait()`` only
ends at the process-group timeout. So collectives are issued with ``async_op=True`` and
the training thread polls ``work.is_completed()`` while also asking the caller's abort
check. On abort the pending work objects are handed to a graveyard list that the caller
owns: dropping them early would block in their destructor until the timeout.

Runs in the training thread of one rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from torch.distributed import Work

from unbroken.errors import CollectiveAborted

AbortCheck = Callable[[], bool]

_FIRST_SLEEP_S = 50e-6  # short first: a small bucket is done in ~0.3 ms
_MAX_SLEEP_S = 2e-3     # the abort latency bound; polling faster only burns a core gloo needs


def wait_all(works: Sequence[Work], should_abort: AbortCheck | None, graveyard: list[Work],
             what: str) -> None:
    """Wait until every work in ``works`` completed; raise if one failed or on abort.

    ``what`` names the operation for messages (e.g. "gradient all-reduce of step 7").
    Raises :class:`CollectiveAborted` when ``should_abort()`` returns True before all
    works were seen complete (it is asked before each poll, so a step waited on after the
    order went out always aborts); the works not yet completed go to ``graveyard``. A
    work that fails (a peer died) re-raises its torch error with a note, unless the abort
    check also says abort: then it is :class:`CollectiveAborted`, the order being the root
    cause. Without ``should_abort`` it simply waits (blocking) on each work in turn.
    """
    if should_abort is None:
        _wait_blocking(works, graveyard, what)
        return
    pending = list(works)
    sleep_s = _FIRST_SLEEP_S
    while pending:
        # The abort order is checked first, so every rank that sees it aborts the same
        # step, even where its own ops happened to finish.
        if should_abort():
            graveyard.extend(w for w in pending if not w.is_completed())
            raise CollectiveAborted(
                f"{what} aborted on the abort order with {len(pending)} of {len(works)} collective "
                "op(s) not yet seen complete; pending ones stay referenced in `abandoned_work` "
                "until they end (at the latest at the process-group timeout)")
        still = []
        for index, work in enumerate(pending):
            if not work.is_completed():
                still.append(work)
                continue
            try:
                work.wait()  # completed: returns at once, or raises the op's error
            except Exception as err:  # noqa: BLE001 - any backend error ends the op
                graveyard.extend(w for w in pending[index + 1:] if not w.is_completed())
                graveyard.extend(still)
                if should_abort():
                    raise CollectiveAborted(
                        f"{what} aborted on the abort order; it had failed: {err}") from err
                err.add_note(f"unbroken: during the {what}")
                raise
        pending = still
        if pending:
            time.sleep(sleep_s)
            sleep_s = min(sleep_s * 2, _MAX_SLEEP_S)


def _wait_blocking(works: Sequence[Work], graveyard: list[Work], what: str) -> None:
    for index, work in enumerate(works):
        try:
            work.wait()
        except Exception as err:  # noqa: BLE001
            graveyard.extend(w for w in works[index + 1:] if not w.is_completed())
            err.add_note(f"unbroken: during the {what}")
            raise
