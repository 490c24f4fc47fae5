"""The recovery ladder: which strategy handles a fault. Pure policy, no processes.

Rungs, cheapest first (DESIGN.md section 6). A rung is taken only when the job's
``--recover-strategy`` allows it and it is feasible for this fault right now; a rung
that fails or times out falls to the next one. ``exit`` (restart the whole job from the
newest complete checkpoint) is always the last resort while restarts remain, as in
MindCluster, where a job that cannot be recovered in flight is rescheduled.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from unbroken.names import RUNGS, Rung

GIVE_UP = "give-up"


def choose_rung(allowed: Sequence[str], feasible: Mapping[str, bool], *, after: str | None = None) -> str:
    """The first rung below ``after`` that is allowed and feasible; :data:`GIVE_UP` if none.

    ``feasible`` maps a rung to whether it can handle the fault at hand (missing: no).
    ``exit`` needs only to be feasible (restarts left): it is implicitly allowed.
    """
    start = RUNGS.index(after) + 1 if after else 0
    for rung in RUNGS[start:]:
        if (rung in allowed or rung == Rung.EXIT) and feasible.get(rung, False):
            return rung
    return GIVE_UP
