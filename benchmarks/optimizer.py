"""Step time and optimizer memory: unbroken's ShardedOptimizer vs plain DDP + torch AdamW.

    python benchmarks/optimizer.py                       # 4 ranks, gloo, a ~3M-parameter GPT
    python benchmarks/optimizer.py --json results.json   # also write the figures (BENCHMARKS.md)

Rows: ``ddp_adamw`` (DistributedDataParallel + torch.optim.AdamW on every rank),
``unbroken_n1`` (ZeRO-1, no replica), ``unbroken_n2`` (two copies of every shard),
``unbroken_nd`` (num_replicas = world size: full replication). A step is forward + backward +
``opt.step()`` + ``zero_grad``: DDP reduces gradients during backward, ours inside step(),
so only the whole step compares fairly. All four run in the same processes, interleaved
(the order rotates every repeat); each repeat times ``--steps`` steps after a barrier and
the table shows the median (min-max) over repeats of rank 0's time per step.

Then the optimizer memory per parameter on TP x PP x DP layouts of the same model, measured from
live optimizers next to the formula 8 + 8*N/d (benchmarks/optimizer_memory.py; ``--no-layouts``
skips it).

Then (``--commit-nprocs``, default 16; 0 skips) the per-step commit overhead of a managed job
at that many ranks, from benchmarks/commit.py: ``opt.step()`` of a tiny model under
``unbroken run`` (where it includes the step's commit) minus the same under torchrun.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ROWS = ("ddp_adamw", "unbroken_n1", "unbroken_n2", "unbroken_nd")


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.qkv, self.proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for z in self.qkv(self.ln_1(x)).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, block_size: int, n_layer: int, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f, self.head = nn.LayerNorm(n_embd), nn.Linear(n_embd, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant per repeat")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant before the first repeat")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb and our bucket size")
    p.add_argument("--json", default=None, metavar="PATH", help="write the figures here (BENCHMARKS.md layout)")
    p.add_argument("--no-layouts", action="store_true", help="skip the TP/PP/DP optimizer-memory table")
    p.add_argument("--commit-nprocs", type=int, default=16, help="ranks of the commit-overhead run (0: skip it)")
    p.add_argument("--commit-steps", type=int, default=40, help="steps of the commit-overhead run")
    p.add_argument("--worker", nargs=3, default=None, help=argparse.SUPPRESS)  # RANK PORT OUT
    args = p.parse_args(argv)
    if args.world_size < 2 or args.world_size % 2:
        p.error(f"--world-size must be even and >= 2 (N=2 must divide it), got {args.world_size}")
    return args


# -- one rank ---------------------------------------------------------------------------------
def build(args: argparse.Namespace, name: str, world: int):
    from unbroken.optim import ShardedOptimizer

    torch.manual_seed(0)
    model = TinyGPT(args.vocab, args.block_size, args.n_layer, args.n_embd, args.n_head)
    hyper = {"lr": 3e-4, "weight_decay": 0.1, "betas": (0.9, 0.95)}
    bucket_bytes = int(args.bucket_mb * 2**20)
    if name == "ddp_adamw":
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
        return ddp, torch.optim.AdamW(ddp.parameters(), **hyper)
    num_replicas = {"unbroken_n1": 1, "unbroken_n2": 2, "unbroken_nd": world}[name]
    opt = ShardedOptimizer(model, torch.optim.AdamW, num_replicas=num_replicas, bucket_bytes=bucket_bytes, **hyper)
    return model, opt


def state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.nbytes for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.dim() >= 1)


def phase_times(marks: list[tuple[str, float]]) -> dict[str, float]:
    """Median seconds per step from "sync" to "update" and from "update" to "done"."""
    at = [dict(marks[i:i + 3]) for i in range(0, len(marks) - 2, 3)]
    return {"sync_s": statistics.median(m["update"] - m["sync"] for m in at),
            "update_gather_s": statistics.median(m["done"] - m["update"] for m in at)}


def worker(args: argparse.Namespace) -> None:
    rank, port, out = int(args.worker[0]), int(args.worker[1]), Path(args.worker[2])
    world = args.world_size
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    variants = {name: build(args, name, world) for name in ROWS}
    gen = torch.Generator().manual_seed(rank)
    shape = (args.batch_size, args.block_size)
    batches = [torch.randint(args.vocab, shape, generator=gen) for _ in range(2)]

    def run(name: str, steps: int) -> float:
        model, opt = variants[name]
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            model(batches[0], batches[1]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return (time.perf_counter() - start) / steps

    # Inside our step: "sync" -> "update" is the gradient all-reduce, "update" -> "done" the
    # shard update plus the parameter gather.
    marks: dict[str, list[tuple[str, float]]] = {name: [] for name in ROWS}
    for name in ROWS[1:]:
        variants[name][1].on_phase = lambda phase, step, log=marks[name]: log.append((phase, time.perf_counter()))
    for name in ROWS:
        run(name, args.warmup)
        marks[name].clear()
    times: dict[str, list[float]] = {name: [] for name in ROWS}
    for rep in range(args.repeats):
        order = ROWS[rep % len(ROWS):] + ROWS[:rep % len(ROWS)]  # rotate: no variant always first
        for name in order:
            times[name].append(run(name, args.steps))
    numel = sum(p.numel() for p in variants["unbroken_n1"][0].parameters())
    result = {"numel": numel, "times": times, "phases": {name: phase_times(marks[name]) for name in ROWS[1:]},
              "bytes": {name: state_bytes(opt) for name, (_, opt) in variants.items()}}
    if not args.no_layouts:
        import optimizer_memory  # a sibling script (this file's directory is on the path)

        def model() -> nn.Module:
            torch.manual_seed(0)
            return TinyGPT(args.vocab, args.block_size, args.n_layer, args.n_embd, args.n_head)
        result["layouts"] = optimizer_memory.measure(model, world)
    if rank == 0:
        (out / "result.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# -- the launcher -----------------------------------------------------------------------------
def launch(args: argparse.Namespace, argv: list[str]) -> dict:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as out:
        procs = [subprocess.Popen([sys.executable, __file__, *argv, "--worker", str(r), str(store.port), out], env=env)
                 for r in range(args.world_size)]
        try:
            codes = [p.wait() for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        if any(codes):
            raise SystemExit(f"optimizer.py: a rank failed (exit codes {codes})")
        return json.loads((Path(out) / "result.json").read_text())


def summarize(args: argparse.Namespace, raw: dict) -> dict:
    rows = []
    for name in ROWS:
        ts = raw["times"][name]
        rows.append({"name": name, "step_s": statistics.median(ts), "step_s_min": min(ts), "step_s_max": max(ts),
                     "optimizer_bytes_per_param": raw["bytes"][name] / raw["numel"]})
    for row in rows[1:]:
        row.update(raw["phases"][row["name"]])
    base = rows[0]
    for row in rows:
        row["step_ratio"] = row["step_s"] / base["step_s"]
        row["optimizer_bytes_ratio"] = row["optimizer_bytes_per_param"] / base["optimizer_bytes_per_param"]
    params = {k: v for k, v in vars(args).items() if k not in ("json", "worker")}
    params["num_params"] = raw["numel"]
    return {"benchmark": "optimizer", "params": params,
            "machine": {"cpus": os.cpu_count(), "torch": torch.__version__}, "rows": rows,
            "layouts": raw.get("layouts", [])}


def print_table(report: dict) -> None:
    p = report["params"]
    print(f"optimizer step, {p['world_size']} ranks (gloo, 1 thread each), {p['num_params'] / 1e6:.2f}M parameters, "
          f"median of {p['repeats']} repeats x {p['steps']} steps")
    print(f"{'row':<13} {'step_s':>9} {'(min - max)':>19} {'vs ddp':>7} {'opt bytes/param':>16} {'vs ddp':>7}"
          f" {'sync_s':>8} {'upd+gather_s':>13}")
    for row in report["rows"]:
        print(f"{row['name']:<13} {row['step_s']:>9.4f} ({row['step_s_min']:.4f} - {row['step_s_max']:.4f}) "
              f"{row['step_ratio']:>7.2f} {row['optimizer_bytes_per_param']:>16.2f} "
              f"{row['optimizer_bytes_ratio']:>7.2f} {row.get('sync_s', float('nan')):>8.4f} "
              f"{row.get('update_gather_s', float('nan')):>13.4f}")
    d = p["world_size"]
    print(f"formula (fp32 AdamW state): 8*N/d bytes/param -> N=1: {8 / d:.2f}, N=2: {16 / d:.2f}, N=d: 8.00 "
          "(+ 4 params + 4 grads on every rank; seeds' bf16 table: 4 + 16*N/d)")
    if report["layouts"]:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import optimizer_memory  # a sibling script

        optimizer_memory.print_rows(report["layouts"], p["num_params"])


def commit_overhead(nproc: int, steps: int) -> dict:
    """benchmarks/commit.py's two runs at ``nproc`` ranks; prints and returns the per-step commit overhead."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import commit  # a sibling script

    runs = {"unbroken": commit.run_one(commit.default_row(), nproc, steps, 900.0),  # its default settings
            "torchrun": commit.run_one("torchrun", nproc, steps, 900.0)}
    bad = {k: r["error"] for k, r in runs.items() if "error" in r}
    if bad:
        print(f"commit overhead at {nproc} ranks: not measured: {bad}")
        return {"nproc": nproc, "error": bad}
    overhead = runs["unbroken"]["opt_step_s"] - runs["torchrun"]["opt_step_s"]
    print(f"per-step commit overhead at {nproc} ranks (opt.step under unbroken run minus torchrun, tiny model, "
          f"{steps} steps, load {os.getloadavg()[0]:.1f}): {overhead * 1e3:.2f} ms "
          f"({runs['unbroken']['opt_step_s'] * 1e3:.2f} vs {runs['torchrun']['opt_step_s'] * 1e3:.2f} ms)")
    return {"nproc": nproc, "commit_s": overhead, **{f"{k}_opt_step_s": r["opt_step_s"] for k, r in runs.items()}}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker is not None:
        worker(args)
        return
    report = summarize(args, launch(args, argv))
    print_table(report)
    if args.commit_nprocs:
        report["commit"] = commit_overhead(args.commit_nprocs, args.commit_steps)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
