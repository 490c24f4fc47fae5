"""Group-build benchmark: a new gloo group per generation, full mesh vs lazy connections.

    python benchmarks/group_build.py                       # N = 4, 16, 32 ranks, 5 generations each
    python benchmarks/group_build.py --nprocs 4,8 --generations 3 --json build.json

Each recovery builds every group of the job again on a fresh store prefix (parallel/fabric.py).
gloo's default build connects every pair (N-1 connections and store lookups per rank, before
the constructor returns); with ``lazy_init`` (torch's ``TORCH_GLOO_LAZY_INIT``, here set on the
device of that one group only) a pair connects on its first use, and a ring all-reduce uses 2
peers. This script starts N processes on one TCPStore and, per generation and mode, times on
every rank: the constructor (``build_s``), the first 1-element all-reduce (``first_s``, which
pays the lazy connections), a second one (``second_s``), then the same with a 1 MiB tensor.
Printed: the median over generations of the slowest rank's time (a regroup waits for the
slowest). This machine has 2 cores: at N >> cores the figures are scheduling; compare the
modes of one run. A benchmark never asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

MODES = ("eager", "lazy")


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def rank_main(rank: int, size: int, port: int, generations: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from unbroken.comm.groups import gloo_group

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timedelta(seconds=300))
    timeout = timedelta(seconds=300)
    small, big = torch.ones(1), torch.ones(256 * 1024)
    rows, keep = [], []  # groups stay referenced: dropping one is not what is measured
    for gen in range(generations):
        for mode in MODES:
            dist.PrefixStore(f"sync/{gen}/{mode}", store).add("n", 1)  # start together
            while int(dist.PrefixStore(f"sync/{gen}/{mode}", store).add("n", 0)) < size:
                time.sleep(0.001)
            prefix = dist.PrefixStore(f"gen{gen}/{mode}/", store)
            holder = {}
            row = {"gen": gen, "mode": mode}
            row["build_s"] = _timed(lambda: holder.setdefault("pg", gloo_group(prefix, rank, size, timeout,
                                                                               lazy_connect=mode == "lazy")))
            pg = holder["pg"]
            row["first_s"] = _timed(lambda: pg.allreduce([small]).wait())
            row["second_s"] = _timed(lambda: pg.allreduce([small]).wait())
            row["first_1mib_s"] = _timed(lambda: pg.allreduce([big]).wait())
            row["second_1mib_s"] = _timed(lambda: pg.allreduce([big]).wait())
            keep.append(pg)
            rows.append(row)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(rows))
    dist.PrefixStore("done", store).add("n", 1)
    while int(dist.PrefixStore("done", store).add("n", 0)) < size:  # rank 0 hosts the store: leave last
        time.sleep(0.01)


def run_size(size: int, generations: int, timeout_s: float) -> dict:
    import tempfile

    import torch.multiprocessing as mp

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from runlib import free_port

    with tempfile.TemporaryDirectory(prefix="unbroken-group-build-") as tmp:
        ctx = mp.get_context("spawn")
        port = free_port()
        procs = [ctx.Process(target=rank_main, args=(r, size, port, generations, tmp)) for r in range(size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        ranks = [json.loads(f.read_text()) for f in sorted(Path(tmp).glob("rank*.json"))]
    if len(ranks) != size:
        return {"error": f"{len(ranks)} of {size} ranks finished within {timeout_s} s"}
    out: dict = {}
    for mode in MODES:
        for key in ("build_s", "first_s", "second_s", "first_1mib_s", "second_1mib_s"):
            per_gen = [max(r[i][key] for r in ranks) for i in range(len(ranks[0])) if ranks[0][i]["mode"] == mode]
            out[f"{mode}_{key}"] = statistics.median(per_gen[1:] if len(per_gen) > 1 else per_gen)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nprocs", default="4,16,32", help="world sizes, comma-separated")
    p.add_argument("--generations", type=int, default=5, help="groups built per mode (the first is left out)")
    p.add_argument("--run-timeout-s", type=float, default=600.0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    load_before = os.getloadavg()[0]
    rows = []
    for size in (int(n) for n in args.nprocs.split(",")):
        print(f"N={size} ...", flush=True)
        rows.append({"nproc": size, **run_size(size, args.generations, args.run_timeout_s)})
        print(f"  {rows[-1]}", flush=True)
    print(f"\ngloo group build per generation, slowest rank, median of {args.generations - 1} generations; "
          f"load {load_before:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus")
    keys = ("build_s", "first_s", "second_s", "first_1mib_s")
    print(f"{'N':>4} " + " ".join(f"{m + ' ' + k:>20}" for m in MODES for k in keys))
    for row in rows:
        cells = [f"{row[f'{m}_{k}'] * 1e3:.1f} ms" if f"{m}_{k}" in row else "-" for m in MODES for k in keys]
        print(f"{row['nproc']:>4} " + " ".join(f"{c:>20}" for c in cells))
    if args.json:
        Path(args.json).write_text(json.dumps({"benchmark": "group_build", "params": vars(args), "rows": rows},
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
