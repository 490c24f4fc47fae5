"""Failover benchmark: how long the job's controller seat is empty when its leader is lost.

    python benchmarks/failover.py [--repeats 5] [--ttl-s 1] [--members 3] [--json F]

Needs etcd on PATH (``bash scripts/quickstart.sh test`` installs Debian's etcd-server) and the
test extra (it reuses the tests' etcd launcher and candidate process). Per repeat: a fresh job
prefix, two candidate controllers as processes (``tests/consensus/candidate.py``: campaign,
then commit one step after another while leading), one of them leads and commits; then

  leader_kill       SIGKILL of the leading process
  leader_partition  SIGSTOP of the leading process (SIGCONT and a kill afterwards)

failover_s: the fault -> the new leader's key seen in etcd (polled every 10 ms);
resume_s: the fault -> the first step committed by the new leader's term.
Both are bounded below by the lease TTL (``--ttl-s``): etcd lets a lease go only after it.

Not measured yet: the issue's ``controller_failover`` row with ``recover_s`` (the fault -> the
job training again on a standby), which needs the agents to host these seats
(see docs/controller-failover.md). A benchmark never asserts a time.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.consensus.test_partition import start  # noqa: E402  (the candidate process)
from tests.etcd_cluster import EtcdCluster  # noqa: E402
from unbroken.consensus.durable import DurableStore  # noqa: E402
from unbroken.consensus.election import read_leader  # noqa: E402
from unbroken.consensus.etcd import EtcdClient  # noqa: E402


def one(cluster: EtcdCluster, root: Path, fault: str, ttl_s: int, index: int) -> dict[str, float]:
    prefix = f"/unbroken/bench-{fault}-{index}/"
    client = EtcdClient(cluster.endpoints, timeout_s=1.0)
    store = DurableStore(client, prefix.encode())
    out = root / f"{fault}-{index}.jsonl"
    procs = {n: start(cluster, n, out, steps=10**6, prefix=prefix, ttl_s=ttl_s) for n in ("a", "b")}
    try:
        deadline = time.monotonic() + 30
        while len(store.commits()) < 3:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no leader committed 3 steps in 30 s (see {out})")
            time.sleep(0.02)
        first = read_leader(client, prefix.encode())
        victim = procs[first.node]
        t0 = time.monotonic()
        victim.send_signal(signal.SIGKILL if fault == "leader_kill" else signal.SIGSTOP)
        failover_s = resume_s = None
        while resume_s is None:
            if time.monotonic() - t0 > 30:
                raise RuntimeError(f"no new leader within 30 s of the {fault}")
            leader = read_leader(client, prefix.encode())
            if failover_s is None and leader is not None and leader.term > first.term:
                failover_s = time.monotonic() - t0
            if failover_s is not None and any(c.term > first.term for c in store.commits()[-3:]):
                resume_s = time.monotonic() - t0
            time.sleep(0.01)
        return {"failover_s": failover_s, "resume_s": resume_s}
    finally:
        for proc in procs.values():
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait(10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ttl-s", type=int, default=1)
    parser.add_argument("--members", type=int, choices=(1, 3), default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="unbroken-failover-") as tmp:
        cluster = EtcdCluster(Path(tmp), args.members)
        try:
            for fault in ("leader_kill", "leader_partition"):
                runs = [one(cluster, Path(tmp), fault, args.ttl_s, i) for i in range(args.repeats)]
                row = {"row": fault, "repeats": args.repeats, "ttl_s": args.ttl_s, "etcd_members": args.members}
                for name in ("failover_s", "resume_s"):
                    values = [r[name] for r in runs]
                    row[name] = statistics.median(values)
                    row[f"{name}_min"], row[f"{name}_max"] = min(values), max(values)
                rows.append(row)
                print(f"{fault:>17}  failover_s {row['failover_s']:.3f} [{row['failover_s_min']:.3f}, "
                      f"{row['failover_s_max']:.3f}]  resume_s {row['resume_s']:.3f}")
        finally:
            cluster.close()
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "failover", "params": {k: str(v) for k, v in vars(args).items()},
                                         "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
