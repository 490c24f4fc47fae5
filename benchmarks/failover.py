"""Failover benchmark: how long the job's controller seat is empty when its leader is lost.

    python benchmarks/failover.py [--repeats 5] [--ttl-s 1] [--members 3] [--job-repeats 1] [--json F]

Needs etcd on PATH (``bash scripts/quickstart.sh test`` installs Debian's etcd-server) and the
test extra (it reuses the tests' etcd launcher and candidate process). Per repeat: a fresh job
prefix, two candidate controllers as processes (``tests/consensus/candidate.py``: campaign,
then commit one step after another while leading), one of them leads and commits; then

  leader_kill       SIGKILL of the leading process
  leader_partition  SIGSTOP of the leading process (SIGCONT and a kill afterwards)

failover_s: the fault -> the new leader's key seen in etcd (polled every 10 ms);
resume_s: the fault -> the first step committed by the new leader's term.
Both are bounded below by the lease TTL (``--ttl-s``): etcd lets a lease go only after it.

controller_failover: a real job (``tests/failover/job.py``): 2 nodes of 1 rank and a standby agent
on loopback, ``unbroken run --controller-store`` (lease ``--ttl-s``), the example trainer with
``--save`` (storage every step); SIGKILL of node 0's agent (the leader) and its worker after rank 0's
step 10. failover_s: the kill -> the new leader's key in etcd; recover_s: the kill -> the first step
completed after the restart (rank 0's step line, on the standby now); caught_up_s: the kill -> every
rank back at the step the fault hit (the new controller's ``recovered`` event); restored_step: the
step the job restarted from (lost_steps: the fault's step minus it); takeover_s, attempt_started_s,
restore_decided_s: the kill -> those events of the new controller (where recover_s goes). A benchmark never asserts a time.
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


KILL_AFTER_STEP = 10  # rank 0's step line after which node 0 is killed (the persister has warmed up)


def controller_failover(cluster: EtcdCluster, root: Path, ttl_s: int, index: int) -> dict[str, float]:
    """One run of the controller_failover row (see the module docstring)."""
    from tests.failover.job import SECRET, FailoverJob
    from tests.integration.helpers import events
    from unbroken.consensus.durable import job_prefix
    from unbroken.consensus.election import wait_for_leader

    tmp = root / f"job-{index}"
    tmp.mkdir()
    train = ["--step-sleep-s", "0.2", "--log-every", "1"]
    flags = ["--recover-strategy", "recover,exit", "--node-timeout-s", "5", "--first-step-timeout-s", "300",
             "--save", str(tmp / "ckpt"), "--persist-every-steps", "1", "--controller-lease-s", str(ttl_s)]
    job = FailoverJob(tmp, "etcd://" + ",".join(f"{h}:{p}" for h, p in cluster.endpoints), steps=KILL_AFTER_STEP + 12,
                      flags=flags, train_args=train)
    client = EtcdClient(cluster.endpoints, timeout_s=1.0)
    prefix = job_prefix(SECRET, job.job_id)
    try:
        first = wait_for_leader(client, prefix, timeout_s=60)
        job.wait_for(lambda: job.printed(f"[rank 0] step {KILL_AFTER_STEP}:"), 600, "rank 0 at the fault's step")
        survivors = [job.agents[1], job.standby]
        seen = [len(a.lines) for a in survivors]
        job.agents[0].kill_all()
        t0, killed_wall_t = time.monotonic(), time.time()
        failover_s = recover_s = None
        while recover_s is None:
            if time.monotonic() - t0 > 600:
                raise RuntimeError(f"the job did not train again within 600 s of the kill\n{job.outputs()}")
            if failover_s is None:
                leader = read_leader(client, prefix)
                if leader is not None and leader.term > first.term:
                    failover_s = time.monotonic() - t0
            if any("] step " in line for a, n in zip(survivors, seen) for line in a.lines[n:]):
                recover_s = time.monotonic() - t0
            time.sleep(0.01)
        if job.finish(600, survivors) != [0, 0]:
            raise RuntimeError(f"the job did not end with exit 0 after the takeover\n{job.outputs()}")
        run_dir = next(job.run_dir(n) for n in ("node1", "standby") if events(job.run_dir(n), "controller_takeover"))
        (recovered,) = events(run_dir, "recovered")

        def since_kill(event: str) -> float:  # the first such event of the new controller
            return round(events(run_dir, event)[0]["t"] - killed_wall_t, 3)

        return {"failover_s": failover_s, "recover_s": recover_s,
                "caught_up_s": round(recovered["t"] - killed_wall_t, 3), "restored_step": recovered["restored_step"],
                "tier": recovered.get("tier", ""),
                "lost_steps": KILL_AFTER_STEP - recovered["restored_step"],
                "takeover_s": since_kill("controller_takeover"), "attempt_started_s": since_kill("attempt_started"),
                "restore_decided_s": since_kill("restore_decided")}
    finally:
        job.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ttl-s", type=int, default=1)
    parser.add_argument("--members", type=int, choices=(1, 3), default=3)
    parser.add_argument("--job-repeats", type=int, default=1,
                        help="runs of the controller_failover row (a real job each: about a minute)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="unbroken-failover-") as tmp:
        cluster = EtcdCluster(Path(tmp), args.members)
        try:
            for fault in ("leader_kill", "leader_partition") if args.repeats else ():
                runs = [one(cluster, Path(tmp), fault, args.ttl_s, i) for i in range(args.repeats)]
                row = {"row": fault, "repeats": args.repeats, "ttl_s": args.ttl_s, "etcd_members": args.members}
                for name in ("failover_s", "resume_s"):
                    values = [r[name] for r in runs]
                    row[name] = statistics.median(values)
                    row[f"{name}_min"], row[f"{name}_max"] = min(values), max(values)
                rows.append(row)
                print(f"{fault:>17}  failover_s {row['failover_s']:.3f} [{row['failover_s_min']:.3f}, "
                      f"{row['failover_s_max']:.3f}]  resume_s {row['resume_s']:.3f}")
            if args.job_repeats:
                runs = [controller_failover(cluster, Path(tmp), args.ttl_s, i) for i in range(args.job_repeats)]
                row = {"row": "controller_failover", "repeats": args.job_repeats, "ttl_s": args.ttl_s,
                       "etcd_members": args.members, "nodes": 2, "ranks_per_node": 1, "standby": 1}
                for name in ("failover_s", "recover_s", "caught_up_s", "restored_step", "lost_steps", "takeover_s",
                             "attempt_started_s", "restore_decided_s"):
                    values = [r[name] for r in runs]
                    row[name] = statistics.median(values)
                    row[f"{name}_min"], row[f"{name}_max"] = min(values), max(values)
                row["tiers"] = [r["tier"] for r in runs]  # where the restart's ranks restored from
                rows.append(row)
                print(f"controller_failover  failover_s {row['failover_s']:.3f}  recover_s {row['recover_s']:.3f}  "
                      f"caught_up_s {row['caught_up_s']:.3f}  restored_step {row['restored_step']}")
        finally:
            cluster.close()
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "failover", "params": {k: str(v) for k, v in vars(args).items()},
                                         "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
