"""Commit benchmark: what the per-step commit costs, by world size.

    python benchmarks/commit.py                        # N = 4, 16, 32 ranks, 60 steps each
    python benchmarks/commit.py --nprocs 4,16 --steps 40 --json commit.json
    python benchmarks/commit.py --nprocs 16 --ranks-per-node 8 --rows before,direct,nodes,torchrun --before-src DIR

Every step of a managed job commits before its optimizer update (worker/step_boundary.py
`_commit`): the rank reports its reduction done (StepSynced, to the controller or its agent, not
waited for) and joins the step's commit vote, a one-element all-reduce among the ranks
(recovery/consistency.py); before 2026-12-06 it waited for the controller's commit instead, a round
trip (the ``before`` row of an older tree shows it). This script runs a tiny model (one all-reduce
of a 64-float gradient per step, SGD) on N ranks in each row, interleaved:

  direct     `unbroken run`, setting node_reports off: every rank sends its step reports to the
             controller; `opt.step()` includes the commit (the vote)
  nodes      `unbroken run`, setting node_reports on: each agent batches its ranks' reports (agent/relay.py)
  before     `unbroken run` from another source tree (--before-src, e.g. a `git archive` of main)
  torchrun   `python -m torch.distributed.run`: the same script, no controller, no commit

``--ranks-per-node 8`` starts one agent per 8 ranks on this machine, as nodes of a cluster
would have (default: one agent for all). Per N and row: the median over ranks of each rank's
median `opt.step()` time and whole step time; commit_s = a row's opt_step_s - torchrun's.
Messages per step at the controller: counted by the controller (its job-end event
``control_messages``: every worker message in and out, heartbeats left out, and the agents'
batches), divided by the steps. This machine has 2 cores: at 16
and 32 ranks every process waits for a core, so absolute figures are mostly scheduling;
compare the rows of one run.
A benchmark never asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def worker(args: argparse.Namespace) -> int:
    """One rank: the tiny training loop, timing opt.step() (which includes the commit)."""
    import torch

    import unbroken

    torch.set_num_threads(1)
    job = unbroken.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    job.track(model=model, optimizer=opt)
    opt_s, step_s = [], []
    for step in job.steps(args.steps):
        t0 = time.perf_counter()
        with job.step():
            loss = model(torch.randn(4, 8)).square().mean()
            loss.backward()
            for p in model.parameters():
                job.all_reduce(p.grad)
            t1 = time.perf_counter()
            opt.step()
            opt_s.append(time.perf_counter() - t1)
            opt.zero_grad()
        step_s.append(time.perf_counter() - t0)
    warm = args.steps // 4  # the first steps include connection set-up
    out = {"opt_step_s": statistics.median(opt_s[warm:]), "step_s": statistics.median(step_s[warm:])}
    Path(args.out_dir, f"rank{job.rank}.json").write_text(json.dumps(out))
    job.close()
    return 0


def messages_per_step(run_dir: Path, steps: int) -> float | None:
    """Control messages per step at the controller (workers' in + out, heartbeats left out: they
    go by time, not by step), from the job-end event ``control_messages``."""
    from runlib import read_events

    counts = [ev for ev in read_events(run_dir) if ev.get("event") == "control_messages"]
    if not counts:
        return None
    received, sent = counts[-1]["received"], counts[-1]["sent"]
    total = sum(received.values()) - received.get("Heartbeat", 0) + sum(sent.values())
    return total / steps


#: The rows, each a way to run the same script: under `unbroken run` with the step reports sent
#: by each rank to the controller (``direct``) or batched per node by the agents (``nodes``,
#: agent/relay.py); ``before``: `unbroken run` from another source tree (``--before-src``: a
#: `git archive` of main), with its own defaults; ``torchrun``: no controller, no commit.
ROWS = ("before", "direct", "nodes", "torchrun")


def unbroken_flags(kind: str) -> list[str]:
    """The `unbroken run` flags of a row: the setting node_reports' one switch is the non-default value."""
    from unbroken.config import WorkerSettings

    on = WorkerSettings().node_reports
    return {"before": [], "direct": ["--no-node-reports"] if on else [], "nodes": [] if on else ["--node-reports"]}[kind]


def default_row() -> str:
    """The row that runs `unbroken run` with its default settings."""
    from unbroken.config import WorkerSettings

    return "nodes" if WorkerSettings().node_reports else "direct"


def run_one(kind: str, nproc: int, steps: int, timeout_s: float, ranks_per_node: int = 0,
            before_src: str = "") -> dict:
    from runlib import free_port, launch, unbroken_cmd

    with tempfile.TemporaryDirectory(prefix="unbroken-commit-bench-") as tmp:
        script = [str(Path(__file__).resolve()), "--worker", "--steps", str(steps), "--out-dir", tmp]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        others: list[subprocess.Popen] = []
        if kind != "torchrun":
            if kind == "before":
                env["PYTHONPATH"] = before_src
            per_node = ranks_per_node if 0 < ranks_per_node < nproc else nproc
            nnodes, port = nproc // per_node, free_port()
            # start-up is not what is measured: N interpreters on 2 loaded cores can take minutes
            run = [*unbroken_cmd(), "run", "--nproc-per-node", str(per_node), "--first-step-timeout-s", "600",
                   *unbroken_flags(kind)]
            if nnodes > 1:  # several agents on this machine, one per "node", as on a cluster
                env["UNBROKEN_JOB_SECRET"] = "commit-bench-secret-" + "0123456789abcdef" * 2
                run += ["--nnodes", str(nnodes), "--master-addr", "127.0.0.1", "--master-port", str(port)]
                others = [subprocess.Popen([*run, "--node-rank", str(i), "--run-dir", f"{tmp}/run{i}", *script],
                                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                           start_new_session=True) for i in range(1, nnodes)]
            cmd = [*run, "--run-dir", f"{tmp}/run", *script]
        else:
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", *script]
        try:
            res = launch(cmd, env, timeout_s, echo=False)
        finally:
            for other in others:
                try:
                    other.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(other.pid, signal.SIGKILL)
                    other.wait()
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
        if res.rc != 0 or len(ranks) != nproc:
            tail = "\n".join(line for _, line in res.lines[-10:])
            return {"error": f"exit {res.rc}, {len(ranks)} of {nproc} ranks reported, timed out {res.timed_out}\n{tail}"}
        out = {k: statistics.median(r[k] for r in ranks) for k in ("opt_step_s", "step_s")} | {"job_s": res.job_s}
        if kind != "torchrun":
            out["msgs_per_step"] = messages_per_step(Path(tmp, "run"), steps)
            decisions = recoveries(Path(tmp, "run"))
            if decisions:  # not a steady step: a rank was taken for hung or lost (left out of the figures)
                out["error"] = f"{len(decisions)} recoveries in a fault-free run, the first: {decisions[0]}"
        return out


def recoveries(run_dir: Path) -> list[str]:
    """The reasons of the recovery decisions of a run (none in a steady, fault-free one)."""
    from runlib import read_events

    return [ev.get("reason", "") for ev in read_events(run_dir) if ev.get("event") == "decision"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nprocs", default="4,16,32", help="world sizes, comma-separated")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=1, help="runs per (row, N), interleaved")
    p.add_argument("--rows", default="direct,nodes,torchrun", help=f"comma-separated, of {', '.join(ROWS)}")
    p.add_argument("--before-src", default="", help="row 'before': the source tree to run (a git archive of main)")
    p.add_argument("--ranks-per-node", type=int, default=0,
                   help="start one agent per this many ranks, all on this machine (0: one agent for all)")
    p.add_argument("--run-timeout-s", type=float, default=600.0)
    p.add_argument("--json", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    kinds = [k for k in args.rows.split(",") if k]
    bad = [k for k in kinds if k not in ROWS] + (["before (needs --before-src)"] if "before" in kinds and
                                                 not args.before_src else [])
    if bad or "torchrun" not in kinds:
        p.error(f"--rows: {', '.join(bad) or 'torchrun missing (commit_s is measured against it)'}; "
                f"allowed: {', '.join(ROWS)}")
    nprocs = [int(n) for n in args.nprocs.split(",")]
    load_before = os.getloadavg()[0]
    rows = []
    for nproc in nprocs:
        got: dict[str, list[dict]] = {kind: [] for kind in kinds}
        for _ in range(args.repeats):
            for kind in got:
                print(f"N={nproc} {kind} ... (load {os.getloadavg()[0]:.1f})", flush=True)
                got[kind].append(run_one(kind, nproc, args.steps, args.run_timeout_s, args.ranks_per_node,
                                         args.before_src))
                print(f"  {got[kind][-1]}", flush=True)
        for kind, runs in got.items():
            good = [r for r in runs if "error" not in r]
            row: dict = {"nproc": nproc, "row": kind}
            for key in ("opt_step_s", "step_s"):
                row[key] = statistics.median(r[key] for r in good) if good else None
            counted = [r["msgs_per_step"] for r in good if r.get("msgs_per_step") is not None]
            row["msgs_per_step"] = statistics.median(counted) if counted else None
            rows.append(row)
        base = next(r for r in rows if r["nproc"] == nproc and r["row"] == "torchrun")
        for row in rows:
            if row["nproc"] == nproc and row["row"] != "torchrun" and None not in (row["opt_step_s"],
                                                                                  base["opt_step_s"]):
                row["commit_s"] = row["opt_step_s"] - base["opt_step_s"]
    print(f"\nthe commit per step, tiny model, {args.steps} steps, median over ranks of per-rank medians "
          f"(first quarter of steps left out), ranks per agent: {args.ranks_per_node or 'all'}; load "
          f"{load_before:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus: N ranks share the cores, "
          "figures at N >> cpus are mostly scheduling")
    print(f"{'N':>4} {'row':>9} {'opt.step':>10} {'commit_s':>10} {'step':>10} {'vs torchrun':>12} {'ctl msgs/step':>14}")
    fmt = lambda v: "-" if v is None else f"{v * 1e3:.2f} ms"  # noqa: E731
    for row in rows:
        msgs = "-" if row["msgs_per_step"] is None else f"{row['msgs_per_step']:.1f}"
        base = next(r for r in rows if r["nproc"] == row["nproc"] and r["row"] == "torchrun")
        ratio = row["step_s"] / base["step_s"] if row["step_s"] and base["step_s"] else None
        row["vs_torchrun"] = ratio
        print(f"{row['nproc']:>4} {row['row']:>9} {fmt(row['opt_step_s']):>10} {fmt(row.get('commit_s')):>10} "
              f"{fmt(row['step_s']):>10} {'-' if ratio is None else f'{ratio:.3f}x':>12} {msgs:>14}")
    if args.json:
        Path(args.json).write_text(json.dumps({"benchmark": "commit", "params": vars(args), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
