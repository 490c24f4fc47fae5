"""An unchanged torchrun script: no unbroken API, the default env:// rendezvous."""

import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
assert rank == int(os.environ["RANK"]) and world == int(os.environ["WORLD_SIZE"])
assert int(os.environ["LOCAL_WORLD_SIZE"]) == world and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
print(f"rank {rank} of {world}: sum {t.item():.0f}", flush=True)
dist.destroy_process_group()
