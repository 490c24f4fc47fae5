"""The recovery ladder: which strategy handles a fault. Pure policy, no processes.

Rungs, cheapest first (DESIGN.md section 6). A rung is taken only when the job's
``--recover-strategy`` allows it and it is feasible for this fault right now; a rung
that fails or times out falls to the next one. ``exit`` (restart the whole job from the
newest complete checkpoint) is the usual last resort while restarts remain, as in
MindCluster, where a job that cannot be recovered in flight is rescheduled; like every
rung it is taken only when allowed: when no allowed rung is feasible the answer is
:data:`GIVE_UP` (the job fails, saying why).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from unbroken.names import RUNGS

GIVE_UP = "give-up"


def choose_rung(allowed: Sequence[str], feasible: Mapping[str, bool], *, after: str | None = None) -> str:
    """The first rung below ``after`` that is allowed and feasible; :data:`GIVE_UP` if none.

    ``feasible`` maps a rung to whether it can handle the fault at hand (missing: no).
    A rung that is not in ``allowed`` is never taken, however feasible.
    """
    start = RUNGS.index(after) + 1 if after else 0
    for rung in RUNGS[start:]:
        if rung in allowed and feasible.get(rung, False):
            return rung
    return GIVE_UP
