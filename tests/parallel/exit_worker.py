"""One rank of tests/parallel/test_exit_pending.py: it ends the job with an abandoned op pending.

Rank 1 issues an all-reduce on the world SurvivingGroup that rank 0 never joins and leaves it on
the abort signal (as a survivor leaves a dp all-reduce whose peer left the step); both ranks move
to generation 1, do one all-reduce there, and close as a session does: InFlight.release_graveyard,
then the fabric's teardown, then a normal interpreter exit (no os._exit).
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist

from unbroken.errors import CollectiveAborted
from unbroken.parallel.fabric import Fabric
from unbroken.worker.inflight import InFlight


def main() -> int:
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60), wait_for_workers=False)
    fabric = Fabric(store, rank, 2, timeout_s=30.0, name="exit")
    world = fabric.init_world()
    fabric.switch(0)
    if rank == 1:
        work = dist.all_reduce(torch.ones(4), group=world, async_op=True)  # rank 0 never joins it
        fabric.signal.fire("test order")
        try:
            work.wait()
        except CollectiveAborted:
            pass
    fabric.switch(1)
    dist.all_reduce(torch.ones(4), group=world)
    cfg = SimpleNamespace(rank=rank, replacement=False, worker=SimpleNamespace(pg_timeout_s=30.0))
    inflight = InFlight(cfg, device=torch.device("cpu"), control=None, store=None, group=None, tracked=None,
                        injector=None, dump=None, fabric=fabric)
    print(f"rank {rank}: pending before close {fabric.prune_graveyard()}", flush=True)
    if inflight.release_graveyard():
        fabric.close()
    if rank == 0:  # rank 1 is at its exit by now: before the fix, blocked dropping the old backend
        time.sleep(5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
