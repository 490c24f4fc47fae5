"""Bringing a ShardedOptimizer back after ranks were lost: shards and parameters from live holders.

:meth:`ShardedOptimizer.recover` runs these steps, through the optimizer's public methods; it is a collective over the next generation's process group, run by every rank
(survivors and replacements) in the same order. For every shard it picks one live holder
(the lowest surviving rank that holds it, from the replica map) as the source, then:

1. survivors whose last step's parameter gather was cut complete the step's bookkeeping:
   the step was committed and their shard already updated;
2. each replaced rank receives its shard's optimizer state (and step count) from the source;
3. every rank receives each shard's parameter range from its source, so all ranks end
   with bit-identical parameters.

Runs in the training thread of each rank.
"""

from __future__ import annotations

from typing import Any, Iterable, Protocol

import torch
import torch.distributed as dist

from unbroken.errors import NoLiveReplica
from unbroken.comm.wait import wait_all
from unbroken.optim.layout import FlatLayout
from unbroken.recovery.replica_map import Piece, ReplicaMap
from unbroken.comm.transfer import broadcast_state



class ShardedOptimizer(Protocol):
    """What repair uses of :class:`unbroken.optim.ShardedOptimizer`: its public side only (not
    imported: it imports this module)."""

    rank: int
    world_size: int
    step_count: int
    layout: FlatLayout
    replica_map: ReplicaMap
    process_group: dist.ProcessGroup
    should_abort: Any
    flat_param: torch.Tensor
    abandoned_work: list

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def shard_sources(opt: ShardedOptimizer, replaced: Iterable[int]) -> dict[int, int]:
    """For every shard, the live rank that sends it; raises NoLiveReplica if one has none."""
    alive = [r for r in range(opt.world_size) if r not in set(replaced)]
    sources = {}
    for shard in range(opt.layout.num_shards):
        piece = Piece("optimizer_shard", shard)
        src = opt.replica_map.live_source(piece, alive)
        if src is None:
            holders = opt.replica_map.holders(piece)
            raise NoLiveReplica(f"optimizer shard {shard} has no live holder: its holders {holders} were all lost "
                                "(restore from a checkpoint instead)")
        sources[shard] = src
    return sources


def send_shards(opt: ShardedOptimizer, sources: dict[int, int], replaced: set[int]) -> None:
    """Each replaced rank receives its shard's optimizer state (and step count) from the source."""
    for shard, src in sources.items():
        holders = set(opt.replica_map.holders(Piece("optimizer_shard", shard)))
        if not holders & replaced:
            continue
        state = opt.state_dict() if opt.rank == src else None
        got = broadcast_state(state, src, opt.process_group, device=opt.flat_param.device,
                              should_abort=opt.should_abort, graveyard=opt.abandoned_work,
                              what=f"transfer of optimizer shard {shard} from rank {src}")
        if opt.rank in replaced and opt.rank in holders:
            opt.load_state_dict(got)


@torch.no_grad()
def gather_params(opt: ShardedOptimizer, sources: dict[int, int]) -> None:
    """Every rank receives each shard's parameter range from its source."""
    works = []
    for shard, src in sources.items():
        for a, b in opt.layout.gather_chunks(shard):
            works.append(dist.broadcast(opt.flat_param[a:b], group=opt.process_group, group_src=src, async_op=True))
    wait_all(works, opt.should_abort, opt.abandoned_work, "parameter gather from live holders")


def agree_step_count(opt: ShardedOptimizer) -> int:
    """The step count every rank continues with: the survivors' (completed) or the source's."""
    step = torch.tensor([opt.step_count], dtype=torch.int64, device=opt.flat_param.device)
    wait_all([dist.all_reduce(step, op=dist.ReduceOp.MAX, group=opt.process_group, async_op=True)],
             opt.should_abort, opt.abandoned_work, "step count agreement")
    return int(step.item())
