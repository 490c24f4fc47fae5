"""Start-up benchmark: launch to first completed step, and where the time goes.

    python benchmarks/startup.py                                  # 3 pairs, 4 ranks, this tree
    python benchmarks/startup.py --before-src DIR --repeats 5     # and a `git archive` of main, interleaved
    python benchmarks/startup.py --json startup.json

Each launch is `unbroken run --nproc-per-node N examples/train_gpt.py --steps 3`, timed from the
moment the benchmark starts the launcher. Rows (interleaved, one launch of each per repeat):

  zygote   the default: ranks forked from the node's pre-imported zygote (agent/zygote.py)
  cold     --no-fork-ranks: each rank starts its own Python and imports torch
  pool     ranks forked from a pool (`unbroken pool`, agent/pool.py) started once before the repeats:
           torch imported before the launch, as on a machine that keeps a pool running
  before   the default launch of --before-src (PYTHONPATH = that tree), when given

From the run's event log, per launch: the controller up (``controller_started``), the node's
agent joined (it joins once its zygote is ready), the last rank started, and the first completed
step (``step`` 1). Medians are printed with the range; ``first_step_s`` is the figure issue 30
targets (2 s or less for 4 ranks). A benchmark never asserts a time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from runlib import REPO, clean_shm, launch, read_events, unbroken_cmd

from unbroken.agent import pool

MARKS = (("controller_s", "controller_started"), ("agent_joined_s", "agent_joined"),
         ("ranks_started_s", "rank_started"), ("first_step_s", "step"))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--rows", default="zygote,cold,pool", help="comma-separated: zygote, cold, pool")
    p.add_argument("--before-src", type=Path, default=None, help="a tree of the code to compare (git archive of main)")
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args()


def one(row: str, args: argparse.Namespace, work: Path) -> dict | None:
    run_dir = work / f"{row}-{time.monotonic_ns()}"
    env = dict(os.environ)
    if row == "before":
        env["PYTHONPATH"] = str(args.before_src)
    cmd = unbroken_cmd() + ["run", "--nproc-per-node", str(args.nproc), "--run-dir", str(run_dir)]
    if row == "cold":
        cmd.append("--no-fork-ranks")
    if row == "pool":
        cmd += ["--pool-socket", str(work / "pool" / "pool.sock")]
    cmd += [str(REPO / "examples" / "train_gpt.py"), "--steps", "3"]
    t0 = time.time()
    res = launch(cmd, env, args.timeout_s, False)
    events = read_events(run_dir)
    clean_shm(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    if res.rc != 0:
        print(f"{row}: launch failed (rc {res.rc}); last lines:", *[t for _, t in res.lines[-5:]], sep="\n  ",
              file=sys.stderr)
        return None
    out: dict[str, float] = {"job_s": res.job_s}
    for field, name in MARKS:
        times = [e["t"] for e in events if e.get("event") == name and (name != "step" or e.get("step") == 1)]
        if times:
            out[field] = (max(times) if name == "rank_started" else min(times)) - t0
    return out


@contextlib.contextmanager
def pool_for(work: Path, wanted: bool):
    """`unbroken pool` on a socket of this run, ready before the first launch; stopped after the last."""
    if not wanted:
        yield
        return
    (work / "pool").mkdir(mode=0o700)
    with pool.running(work / "pool" / "pool.sock") as sock:
        if sock is None:
            raise SystemExit("the pool did not start")
        yield


def main() -> int:
    args = parse()
    rows = [r for r in args.rows.split(",") if r]
    if args.before_src is not None:
        rows.append("before")
    results: dict[str, list[dict]] = {r: [] for r in rows}
    with tempfile.TemporaryDirectory(prefix="unbroken-startup-") as tmp, pool_for(Path(tmp), "pool" in rows):
        for i in range(args.repeats):
            for row in rows:
                got = one(row, args, Path(tmp))
                if got is not None:
                    results[row].append(got)
                    print(f"repeat {i + 1} {row}: first step {got.get('first_step_s', float('nan')):.2f} s",
                          file=sys.stderr)
    fields = [f for f, _ in MARKS] + ["job_s"]
    summary = {}
    print(f"\nlaunch -> first completed step, {args.nproc} ranks, medians of {args.repeats} (min-max), "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"{'row':8}" + "".join(f"{f:>22}" for f in fields))
    for row, runs in results.items():
        summary[row] = {}
        cells = []
        for f in fields:
            vals = [r[f] for r in runs if f in r]
            if not vals:
                cells.append(f"{'-':>22}")
                continue
            summary[row][f] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "runs": vals}
            cells.append(f"{statistics.median(vals):>10.2f} ({min(vals):.2f}-{max(vals):.2f})")
        print(f"{row:8}" + "".join(cells))
    base = summary.get("cold", {}).get("first_step_s") or summary.get("before", {}).get("first_step_s")
    ours = summary.get("zygote", {}).get("first_step_s")
    if base and ours:
        which = "cold" if "cold" in summary and summary["cold"].get("first_step_s") else "before"
        print(f"\nfirst step: zygote {ours['median']:.2f} s vs {which} {base['median']:.2f} s: "
              f"{base['median'] / ours['median']:.2f}x faster (target: 2 s or less)")
    if args.json is not None:
        args.json.write_text(json.dumps({"nproc": args.nproc, "repeats": args.repeats, "rows": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
