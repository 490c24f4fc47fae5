"""Sub-health from step timing: the straggler rule. Pure: the server feeds it timings.

A rank's *compute time* in a step is the time from its ``compute`` report (the step began)
to its ``sync`` report (its gradients are ready for the reduction). In synchronous data
parallelism every rank's step takes as long as the slowest one's, so whole-step times
cannot tell who is slow; the compute time can. A rank is a straggler when its median
compute time over its last :data:`WINDOW` steps is more than ``factor`` times the median of
all ranks' medians, and longer by at least :data:`MIN_EXCESS_S` (so that tiny steps'
jitter never counts). A degraded device (thermal throttling, a failing HBM stack, a
neighbour hogging the node) shows up this way before it fails outright.
"""

from __future__ import annotations

import statistics
from typing import Mapping, Sequence

WINDOW = 10  # steps per rank before the rule judges it
MIN_EXCESS_S = 0.05


def stragglers(compute_s: Mapping[int, Sequence[float]], factor: float, *, window: int = WINDOW,
               min_excess_s: float = MIN_EXCESS_S) -> list[tuple[int, float, float]]:
    """(rank, its median, the job's median) of every straggler; [] until every rank has
    ``window`` timings, or when the rule is off (``factor`` <= 0)."""
    if factor <= 0 or len(compute_s) < 2 or any(len(t) < window for t in compute_s.values()):
        return []
    medians = {rank: statistics.median(list(times)[-window:]) for rank, times in compute_s.items()}
    job = statistics.median(medians.values())
    return [(rank, m, job) for rank, m in sorted(medians.items()) if m > factor * job and m - job >= min_excess_s]


def describe(median_s: float, job_median_s: float, window: int = WINDOW) -> str:
    return (f"straggler: median compute time {median_s:.3f} s over its last {window} steps, "
            f"{median_s / job_median_s if job_median_s else float('inf'):.1f}x the job's median {job_median_s:.3f} s")
