"""One rank of the standalone mesh job of tests/parallel/test_mesh.py.

Started by the test, which hosts the TCPStore. A first-generation rank builds its Fabric, joins
generation 0, builds the job's mesh (``build_mesh``: pp x dp x tp over the fabric's groups,
warmed), checks an all-reduce along every dimension, and (``--survive``) moves every group to
generation 1 and checks them again there. A replacement (``--gen 1``) joins generation 1 held,
builds its mesh while the survivors are in their switch (as a replacement process does inside
``unbroken.init()``), is released and checks the same all-reduces. Facts go to
``<out>/rank<R>.gen<G>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

_T0 = time.monotonic()
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from unbroken.parallel.fabric import Fabric
from unbroken.parallel.group import SurvivingGroup
from unbroken.parallel.mesh import build_mesh

DIMS = (("pp", 2), ("dp", 2), ("tp", 1))


def check_dims(mesh, facts: dict, gen: int) -> None:
    """An all-reduce of (rank + 1) along every dimension: the sum over that group's ranks."""
    for name, _ in DIMS:
        group = mesh.group(name)
        t = torch.tensor([float(mesh.rank + 1)])
        dist.all_reduce(t, group=group)
        facts.setdefault("sums", {}).setdefault(str(gen), {})[name] = t.item()
        facts.setdefault("group_ranks", {})[name] = dist.get_process_group_ranks(group)
        facts.setdefault("surviving", {})[name] = isinstance(group, SurvivingGroup)
        facts.setdefault("group_ids", {}).setdefault(str(gen), {})[name] = id(group)
        facts.setdefault("generations", {}).setdefault(str(gen), {})[name] = getattr(group, "generation", None)


def main() -> int:
    p = argparse.ArgumentParser()
    for name in ("rank", "world", "port", "gen"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--survive", action="store_true", help="go on to generation 1 after generation 0")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", args.port, is_master=False, timeout=timedelta(seconds=60),
                          wait_for_workers=False)
    fabric = Fabric(store, args.rank, args.world, timeout_s=30.0, name="mesh")
    fabric.init_world()
    facts = {"rank": args.rank, "pid": os.getpid()}
    if args.gen > 0:  # a replacement: its groups move with the survivors', its mesh is built held
        fabric.switch(args.gen)
        fabric.hold()
    else:
        fabric.switch(0)
    mesh = build_mesh(DIMS, replicate="dp", rank=args.rank, world_size=args.world, device=torch.device("cpu"),
                      fabric=fabric)
    facts["coords"] = {name: mesh.coord(name) for name, _ in DIMS}
    facts["replicas"] = mesh.replica_map.replicas_of(args.rank)
    if args.gen > 0:
        fabric.release()
    facts["mesh_built_s"] = time.monotonic() - _T0
    check_dims(mesh, facts, args.gen)
    if args.survive:
        facts["switch_s"] = fabric.switch(1)
        check_dims(mesh, facts, 1)
    facts["done_s"] = time.monotonic() - _T0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{args.rank}.gen{args.gen}.json").write_text(json.dumps(facts))
    os._exit(0)  # the groups hold no pending op; skip interpreter teardown of live gloo groups


if __name__ == "__main__":
    sys.exit(main())
