"""Durable-state benchmark: what a long job with ``--controller-store`` writes into etcd, by world size.

    python benchmarks/durable_growth.py                                   # N = 64, 256, 1024; this tree
    python benchmarks/durable_growth.py --before-src DIR --json out.json  # and another tree, same run

Needs etcd on PATH (``bash scripts/quickstart.sh test`` installs Debian's etcd-server) and the test
extra (it reuses the tests' etcd launcher). Per tree and N, in a fresh subprocess (PYTHONPATH = the
tree) against a fresh one-member etcd: a leader's term is won, then the leading controller's durable
mirror (agent/failover.py ``DurableMirror``) is offered the job state of a fully replicated N-rank job
at each of ``--steps`` commits, ``--period-ms`` apart (so it writes each one, as at a steady step rate),
with the commit's log entry; nothing else changes. Printed per row:

  state_bytes      the encoded durable state of that job (etcd refuses a request over 2 MiB by default)
  etcd_per_step    etcd's database size after the run, minus before, per commit (bytes): what the
                   job's history costs etcd until it is compacted (its default quota: 2 GiB)
  cpu_per_step     the process's CPU per commit (the mirror's thread: what the leading controller's
                   process spends beside the controller)
  written          whether etcd holds the newest committed step at the end

A benchmark never asserts a time.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from runlib import run_tree_driver  # noqa: E402  (benchmarks/ is not a package)

DRIVER = r'''
import json, sys, tempfile, time
from dataclasses import replace
from pathlib import Path
from tests.etcd_cluster import EtcdCluster
from unbroken.agent.failover import DurableMirror
from unbroken.consensus.durable import DurableStore
from unbroken.consensus.election import Election
from unbroken.consensus.etcd import EtcdClient
from unbroken.controller import machine as sm
from unbroken.controller.durable_mirror import durable_from_job

n, steps, period_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]) / 1e3
cluster = EtcdCluster(Path(tempfile.mkdtemp(prefix="unbroken-durable-bench-")), 1)
try:
    client = EtcdClient(cluster.url, timeout_s=10)
    prefix = b"/unbroken/durable-bench/"
    term = Election(client, prefix, node="agent0", address="127.0.0.1:1", ttl_s=30).campaign(timeout_s=10)
    store = DurableStore(client, prefix)
    job = sm.JobState(sm.JobPolicy(max_restarts=3, allowed=("recover",)), world_size=n, nnodes=max(1, n // 8))
    state_bytes = len(durable_from_job(job).encode())
    before = int(client.status()["dbSize"])
    mirror = DurableMirror(store, term, on_fenced=lambda t: None)
    cpu = time.process_time()
    for step in range(steps):
        mirror.offer(replace(job, committed_step=step))
        mirror.committed({"attempt": 0, "gen": 0, "step": step, "t": time.time()})
        time.sleep(period_s)
    mirror.close(timeout_s=60)
    cpu = time.process_time() - cpu
    loaded = store.load()
    print(json.dumps({"state_bytes": state_bytes,
                      "etcd_per_step": (int(client.status()["dbSize"]) - before) / steps,
                      "cpu_per_step": cpu / steps,
                      "written": loaded is not None and loaded.committed_step == steps - 1}))
finally:
    cluster.close()
'''


def measure(src: Path, n: int, steps: int, period_ms: float, timeout_s: float) -> dict | None:
    # the tree first; tests/ (the etcd launcher) from here
    return run_tree_driver(src, DRIVER, [str(n), str(steps), str(period_ms)], timeout_s, f"N={n}", also_path=[REPO])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nprocs", default="64,256,1024", help="world sizes, comma-separated")
    p.add_argument("--steps", type=int, default=300, help="commits per row")
    p.add_argument("--period-ms", type=float, default=20.0, help="between two commits")
    p.add_argument("--before-src", default="", help="also run this source tree (e.g. a git archive of main)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per row and tree")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    trees = [("ours", REPO)] + ([("before", Path(args.before_src).resolve())] if args.before_src else [])
    results = []
    for n in [int(x) for x in args.nprocs.split(",") if x]:
        for name, src in trees:
            rec = measure(src, n, args.steps, args.period_ms, args.timeout_s)
            results.append({"n": n, "tree": name, **(rec or {})})
            print(f"  N={n} {name}: {rec}", file=sys.stderr)
    print(f"\nA fully replicated job's durable writes into etcd, {args.steps} commits {args.period_ms:g} ms apart\n")
    print("| N ranks | tree | state | etcd growth per commit | CPU per commit | newest step in etcd |")
    print("|---|---|---|---|---|---|")
    for r in results:
        if "state_bytes" not in r:
            print(f"| {r['n']} | {r['tree']} | - | - | - | - |")
            continue
        print(f"| {r['n']} | {r['tree']} | {r['state_bytes'] / 1e3:.1f} kB | {r['etcd_per_step'] / 1e3:.2f} kB | "
              f"{r['cpu_per_step'] * 1e3:.1f} ms | {'yes' if r['written'] else 'NO'} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
