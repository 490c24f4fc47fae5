"""Steady-state cost of a SurvivingGroup vs a plain gloo group: DDP step and one collective (target <= 1.03).

    python benchmarks/parallel_group.py [--world 4] [--steps 30] [--rounds 9] [--width 512] [--ops 100]

Starts ``--world`` ranks (subprocesses of this script, one TCPStore on a free port). Each rank
builds the same MLP twice: one DDP on ``unbroken.parallel``'s SurvivingGroup (attached to a
generation), one DDP on a plain ``ProcessGroupGloo`` registered with ``new_group``; both train
in alternating rounds of ``--steps`` steps (after warm-up; the order flips every round), so
machine noise hits both alike. Then the same for one 1 MiB all-reduce, waited on the two ways
torch's callers wait: ``work.wait()`` (FSDP2, ``dist.all_reduce``) and ``work.get_future()``
(DDP's reducer), ``--ops`` calls per round.

Rank 0 prints a table: per round the median step time of each and their ratio; the median of
the paired-round ratios (the figure the target is read from: a round pair shares the machine's
load of that moment far better than two whole runs do), with its range; the CPU time per step
of the rank's whole process (all threads: what the wrapper adds in Python shows there even when
wall time is noise); the per-collective medians; and the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _paired(rounds: int, run, names=("ours", "plain")) -> dict[str, list[tuple[float, float]]]:
    """``rounds`` rounds of ``run(name) -> (wall, cpu)`` for each name, the order flipped every round."""
    got: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            got[name].append(run(name))
    return got


def _ratios(got: dict[str, list[tuple[float, float]]], index: int = 0) -> list[float]:
    return [o[index] / p[index] for o, p in zip(got["ours"], got["plain"])]


def _rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    sys.path.insert(0, str(REPO))
    from unbroken.parallel.fabric import Fabric

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", args.port, is_master=False, timeout=timedelta(seconds=120),
                          wait_for_workers=False)
    fabric = Fabric(store, args.rank, args.world, name="bench")
    ours = fabric.init_world()
    fabric.switch(0)
    plain = dist.new_group(list(range(args.world)), backend="gloo")  # a real ProcessGroup with gloo
    if not isinstance(plain, dist.ProcessGroup) or plain is ours:
        raise SystemExit("could not build the plain gloo group")
    groups = {"ours": ours, "plain": plain}

    def build(group):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.ReLU())
                                      for _ in range(4)])
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
        return ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3)

    runs = {name: build(group) for name, group in groups.items()}
    x, y = torch.randn(32, args.width), torch.randn(32, args.width)

    def ddp_round(name: str) -> tuple[float, float]:
        ddp, opt = runs[name]
        times, cpu0 = [], time.process_time()
        for _ in range(args.steps):
            t0 = time.perf_counter()
            F.mse_loss(ddp(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
        return statistics.median(times), (time.process_time() - cpu0) / args.steps

    tensor = torch.ones(262144)  # 1 MiB of float32

    def op_round(name: str, how: str) -> tuple[float, float]:
        times, cpu0 = [], time.process_time()
        for _ in range(args.ops):
            t0 = time.perf_counter()
            work = dist.all_reduce(tensor, group=groups[name], async_op=True)
            work.wait() if how == "wait" else work.get_future().wait()
            times.append(time.perf_counter() - t0)
        return statistics.median(times), (time.process_time() - cpu0) / args.ops

    load0 = os.getloadavg()[0]
    for name in runs:
        ddp_round(name)  # warm-up (bucket rebuild, first-call costs)
    ddp = _paired(args.rounds, ddp_round)
    ops = {how: _paired(max(3, args.rounds // 2), lambda name, how=how: op_round(name, how))
           for how in ("wait", "future")}
    if args.rank == 0:
        _report(args, ddp, ops, load0, os.getloadavg()[0])
    os._exit(0)


def _report(args, ddp, ops, load0: float, load1: float) -> None:
    ratios = _ratios(ddp)
    ratio = statistics.median(ratios)
    med = {n: statistics.median(w for w, _ in ddp[n]) for n in ddp}
    cpu = {n: statistics.median(c for _, c in ddp[n]) for n in ddp}
    print(f"SurvivingGroup vs plain gloo: DDP on {args.world} ranks, 4x Linear({args.width}), "
          f"{args.rounds} paired rounds x {args.steps} steps; load average {load0:.1f} -> {load1:.1f} "
          f"on {os.cpu_count()} cores")
    print(f"  {'round':>5} | {'plain ms':>9} | {'ours ms':>9} | {'ratio':>6}")
    for r, ((o, _), (p, _)) in enumerate(zip(ddp["ours"], ddp["plain"])):
        print(f"  {r + 1:>5} | {p * 1e3:9.2f} | {o * 1e3:9.2f} | {o / p:6.3f}")
    print(f"  {'what':<34} | {'plain':>9} | {'ours':>9} | ratio (median of paired rounds)")
    print(f"  {'DDP step, wall ms':<34} | {med['plain'] * 1e3:9.2f} | {med['ours'] * 1e3:9.2f} | "
          f"{ratio:.3f} (range {min(ratios):.3f}-{max(ratios):.3f})")
    print(f"  {'DDP step, CPU ms (all threads)':<34} | {cpu['plain'] * 1e3:9.2f} | {cpu['ours'] * 1e3:9.2f} | "
          f"{statistics.median(_ratios(ddp, 1)):.3f}")
    for how, got in ops.items():
        label = f"1 MiB all-reduce, {'wait()' if how == 'wait' else 'future'}, us"
        o, p = (statistics.median(w for w, _ in got[n]) for n in ("ours", "plain"))
        print(f"  {label:<34} | {p * 1e6:9.0f} | {o * 1e6:9.0f} | {statistics.median(_ratios(got)):.3f}")
    print(f"DDP step ratio {ratio:.3f}, target <= 1.03: {'met' if ratio <= 1.03 else 'NOT met'}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--ops", type=int, default=100, help="all-reduces per round of the per-collective rows")
    p.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    for name in ("world", "steps", "rounds", "width", "ops"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.rank >= 0:
        _rank_main(args)
        return 0
    import torch.distributed as dist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # noqa: F841 - hosts rendezvous
    base = [sys.executable, __file__, "--world", str(args.world), "--steps", str(args.steps), "--rounds",
            str(args.rounds), "--width", str(args.width), "--ops", str(args.ops), "--port", str(port)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(base + ["--rank", str(r)], env=env) for r in range(args.world)]
    codes = [p.wait() for p in procs]
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
