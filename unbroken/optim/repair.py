"""Bringing a ShardedOptimizer back after ranks were lost: shards and parameters from live holders.

:func:`recover` is a collective over the next generation's process group, run by every rank
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

from typing import TYPE_CHECKING, Iterable

import torch
import torch.distributed as dist

from unbroken.errors import NoLiveReplica
from unbroken.comm.wait import wait_all
from unbroken.recovery.replica_map import Piece
from unbroken.comm.transfer import broadcast_state

if TYPE_CHECKING:
    from unbroken.optim.sharded import ShardedOptimizer


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


@torch.no_grad()
def recover(opt: ShardedOptimizer, replaced: Iterable[int]) -> None:
    replaced = set(replaced)
    sources = shard_sources(opt, replaced)
    if opt._gather_pending:  # committed and updated here; the gather below completes it
        opt._gather_pending = False
        opt.step_count += 1
    group = opt.process_group
    device = opt._flat_param.device
    for shard, src in sources.items():
        holders = set(opt.replica_map.holders(Piece("optimizer_shard", shard)))
        if not holders & replaced:
            continue
        state = opt.state_dict() if opt.rank == src else None
        got = broadcast_state(state, src, group, device=device, should_abort=opt.should_abort,
                              graveyard=opt.abandoned_work, what=f"transfer of optimizer shard {shard} from rank {src}")
        if opt.rank in replaced and opt.rank in holders:
            opt.load_state_dict(got)
    works = []
    for shard, src in sources.items():
        for a, b in opt.layout.gather_chunks(shard):
            works.append(dist.broadcast(opt._flat_param[a:b], group=group, group_src=src, async_op=True))
    wait_all(works, opt.should_abort, opt.abandoned_work, "parameter gather from live holders")
    # Every rank now has the same step count: the survivors' (completed) or the source's.
    step = torch.tensor([opt.step_count], dtype=torch.int64, device=device)
    wait_all([dist.all_reduce(step, op=dist.ReduceOp.MAX, group=group, async_op=True)], opt.should_abort,
             opt.abandoned_work, "step count agreement")
    opt.step_count = int(step.item())
    opt.zero_grad(set_to_none=True)
    opt._validated = True
