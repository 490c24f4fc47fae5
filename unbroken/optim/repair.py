"""Bringing a ShardedOptimizer back after ranks were lost: shards and parameters from live holders.

:meth:`ShardedOptimizer.recover` runs these steps, through the optimizer's public methods; it is a collective over the next generation's process group, run by every rank
(survivors and replacements) in the same order. For every shard it picks one live holder
(the lowest surviving rank that holds it, from the replica map) as the source, then:

1. survivors whose last step's parameter gather was cut complete the step's bookkeeping:
   the step was committed and their shard already updated; one small all-reduce agrees on
   the step count and on whether any rank's gather was cut;
2. each replaced rank receives its shard's optimizer state (and step count) from the source,
   point to point (:mod:`unbroken.comm.p2p`): no other rank takes part;
3. each replaced rank receives every shard's parameter range from that shard's source, point
   to point straight into its flat parameter buffer (shards from different sources in
   parallel); only when some survivor's gather was cut does every rank receive every range
   (a broadcast), so all ranks end with bit-identical parameters.

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
from unbroken.comm.p2p import exchange_states, send_recv_tensors
from unbroken.recovery.transfer_plan import Move



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
    """Each replaced rank receives its shard's optimizer state (and step count) from the source,
    point to point; shards from different sources travel in parallel."""
    moves = [Move(f"optimizer shard {shard}", src, dst) for shard, src in sources.items()
             for dst in sorted(set(opt.replica_map.holders(Piece("optimizer_shard", shard))) & replaced)]
    got = exchange_states(moves, opt.process_group, state_of=lambda key: opt.state_dict(),
                          local_of=lambda key: None,  # loading clones the state into the inner optimizer
                          device=opt.flat_param.device, should_abort=opt.should_abort,
                          graveyard=opt.abandoned_work, what="transfer of optimizer shards from live holders")
    for state in got.values():
        opt.load_state_dict(state)


@torch.no_grad()
def gather_params(opt: ShardedOptimizer, sources: dict[int, int], replaced: set[int], everyone: bool) -> None:
    """Each shard's parameter range from its source: to every rank when ``everyone`` (a survivor's
    gather was cut), else point to point to the replaced ranks only."""
    what = "parameter gather from live holders"
    chunks = [(src, a, b) for shard, src in sources.items() for a, b in opt.layout.gather_chunks(shard)]
    if not everyone:
        ops = [(src, dst, opt.flat_param[a:b]) for src, a, b in chunks for dst in sorted(replaced)]
        send_recv_tensors(ops, opt.process_group, should_abort=opt.should_abort, graveyard=opt.abandoned_work,
                          what=what)
        return
    works = [dist.broadcast(opt.flat_param[a:b], group=opt.process_group, group_src=src, async_op=True)
             for src, a, b in chunks]
    wait_all(works, opt.should_abort, opt.abandoned_work, what)


def agree(opt: ShardedOptimizer, gather_cut: bool) -> tuple[int, bool]:
    """(the step count every rank continues with, whether any rank's parameter gather was cut).

    The count is the survivors' highest: a source's (which a replaced rank loads) is never above it.
    """
    flags = torch.tensor([opt.step_count, int(gather_cut)], dtype=torch.int64, device=opt.flat_param.device)
    wait_all([dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=opt.process_group, async_op=True)],
             opt.should_abort, opt.abandoned_work, "step count agreement")
    return int(flags[0].item()), bool(flags[1].item())
