"""One rank's share of the global batch: the data-parallel ranks it runs (rung `elastic`).

Until the job shrinks, a rank runs its own data-parallel rank of a world of ``world_size``. After rung
`elastic` shrank it in exact mode (controller/elastic.py), a survivor also runs some of the lost ranks'
shares (the agent passes them in its environment: :attr:`WorkerConfig.data_ranks`), so the global batch
and the sample order stay those of the fault-free run.

That is exact only if a share's micro-batch is a function of (step, data rank) alone. What this class
can see of it, it reports to the controller with the rank's first committed step (``SessionReady``'s
``not_exact``; the ladder refuses exact mode on any): a script that never asked which shares it runs,
per-rank tracked state (a lost rank's copy went with its node), and random draws inside the step from
the process's global generators (a lost rank's streams are gone; a survivor would draw its own), and
normalization running statistics (per rank, moved by each rank's batches).
Lives in the training thread, owned by :class:`unbroken.worker.session.Job`.
"""

from __future__ import annotations

import random
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.nn.modules.batchnorm import _NormBase

from unbroken.worker_config import WorkerConfig


class DataShare:
    """Which data-parallel ranks this rank runs, and whether its script can keep them exact."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self._ranks, self.world_size = cfg.my_data_ranks, cfg.my_data_world_size
        self._rng_at_first_ask: tuple[torch.Tensor, object] | None = None  # the global streams then

    def ranks(self) -> tuple[int, ...]:
        if self._rng_at_first_ask is None:
            self._rng_at_first_ask = (torch.get_rng_state(), random.getstate())
        return self._ranks

    def not_exact(self, objects: Mapping[str, Any], per_rank: Iterable[str]) -> str:
        """Why this rank's script cannot keep the global batch on fewer ranks ("": nothing seen against it),
        given its tracked ``objects`` and the names of the per-rank ones. Called once, after the first
        committed step."""
        if self._rng_at_first_ask is None:
            return ("the script never called job.data_ranks() in its steps, so its batch cannot be split into the "
                    "data-parallel shards of lost ranks (see docs/recovery.md, 'Losing a node')")
        named = sorted(per_rank)
        if named:
            return (f"its tracked objects {named} are per rank: a lost rank's copy went with its node "
                    "(track them as replicated, or derive them from the step and job.data_ranks())")
        stats = sorted(name for name, obj in objects.items() if isinstance(obj, torch.nn.Module) and any(
            isinstance(m, _NormBase) and m.track_running_stats for m in obj.modules()))
        if stats:
            return (f"its tracked modules {stats} keep normalization running statistics (BatchNorm), which each "
                    "rank's own batches move: a lost rank's went with its node")
        buffers = sorted(name for name, obj in objects.items() if isinstance(obj, torch.nn.Module) and any(
            key not in m._non_persistent_buffers_set for m in obj.modules() for key, t in m._buffers.items()
            if t is not None))
        if buffers:
            return (f"its tracked modules {buffers} keep buffers in their state_dict, which a forward may move with "
                    "each rank's own batches (per-rank state): a lost rank's went with its node (buffers that "
                    "never change: register them with persistent=False)")
        torch_state, python_state = self._rng_at_first_ask
        if not torch.equal(torch_state, torch.get_rng_state()) or python_state != random.getstate():
            return ("its step drew from the global random generators (torch or random: dropout, a shuffle), "
                    "whose streams are per rank and lost with a node; draw from a generator seeded by "
                    "(step, data rank) instead")
        return ""


def sum_in_data_rank_order(parts: Mapping[int, torch.Tensor], data_world_size: int, world_size: int,
                           all_gather: Callable[[torch.Tensor], list[torch.Tensor]]) -> torch.Tensor:
    """The sum over the whole job of one tensor per data-parallel rank (``parts``: this rank's, by data
    rank), added in data-rank order ``((t0 + t1) + t2) + ...`` on every rank: the same bits whatever the
    world size, so a job that shrank in exact mode stays bit-equal to the fault-free run. Costs an
    all-gather of ``ceil(data_world_size / world_size)`` tensors per rank instead of an all-reduce."""
    first = next(iter(parts.values()))
    rows = math.ceil(data_world_size / world_size)
    if len(parts) > rows:
        raise ValueError(f"{len(parts)} data-parallel parts on one rank, at most {rows} "
                         f"(data world {data_world_size}, world {world_size})")
    index = torch.full((rows,), -1, dtype=torch.int64)
    stacked = torch.zeros((rows, first.numel()), dtype=first.dtype, device=first.device)
    for row, (data_rank, part) in enumerate(sorted(parts.items())):
        index[row] = data_rank
        stacked[row].copy_(part.reshape(-1))
    where = {}
    for rank, got in enumerate(all_gather(index)):
        for row, data_rank in enumerate(got.tolist()):
            if data_rank >= 0:
                where[data_rank] = (rank, row)
    if sorted(where) != list(range(data_world_size)):
        raise ValueError(f"the ranks hold data-parallel parts {sorted(where)}, not each of 0..{data_world_size - 1} "
                         "once: every rank must pass its job.data_ranks()")
    gathered = all_gather(stacked)
    total = gathered[where[0][0]][where[0][1]].clone()
    for data_rank in range(1, data_world_size):
        rank, row = where[data_rank]
        total += gathered[rank][row]
    return total.view_as(first)
