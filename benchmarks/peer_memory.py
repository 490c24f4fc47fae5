"""What the peer copies of the memory tier cost (agent/peer_memory.py):

    python benchmarks/peer_memory.py [--size-mb 16 64 256] [--repeats 5] [--train-steps 30] [--json PATH]

Part 1, per snapshot (rows ``peer_copy_<size>mb``): one rank's committed snapshot of --size-mb MiB of
float32 tensors, sent by a PeerMemory (the agent's sender) to another PeerMemory (its ring successor)
over an authenticated loopback connection, received into its slots, verified and committed; and rows
``local_snapshot_<size>mb``, the memory tier's own SnapshotWriter.write + flush of the same state, and
``floor_copy_<size>mb``, one copy_ of it into touched memory. Figures: ``wall_s`` per snapshot,
``cpu_s`` (this process's CPU time per snapshot: sender and receiver, both agents' share),
``network_bytes`` (what crosses the network per snapshot: the slot bytes and two 44-byte headers),
``throughput_bytes_per_s``.

Part 2, training (rows ``train_with_peer_memory``, ``train_without_peer_memory``; --train-steps 0
skips it): the example on two local "nodes" (two `unbroken run` agents on 127.0.0.1, one rank each,
their own --shm-dir), --save with a snapshot every step, with and without --no-peer-memory, runs
interleaved (A B A B); figures ``step_s`` (median step time from the event log), ``job_s``,
``copies_sent``. Printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import runlib  # noqa: E402

from unbroken.agent.peer_memory import PeerMemory  # noqa: E402
from unbroken.checkpoint.memory import SnapshotWriter  # noqa: E402
from unbroken.checkpoint.shm_files import remove_job  # noqa: E402

SECRET = b"peer-memory-benchmark-secret-0123456789"
TENSOR_MB = 4  # the state is a dict of tensors of this size


def _state(size_mb: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = max(1, size_mb // TENSOR_MB)
    return {f"t{i}": torch.randn(TENSOR_MB << 18, generator=g) for i in range(n)}


def copy_rows(size_mb: int, repeats: int, shm: Path) -> list[dict]:
    job = f"bench{uuid.uuid4().hex[:8]}"
    sender = PeerMemory(SECRET, shm, job, 1, lambda: [0], host="127.0.0.1", poll_s=3600)
    keeper = PeerMemory(SECRET, shm, job, 0, lambda: [], host="127.0.0.1", poll_s=3600)
    writer = SnapshotWriter(shm, job, 0)
    rows: dict[str, list[tuple[float, float, int]]] = {"peer_copy": [], "local_snapshot": [], "floor_copy": []}
    try:
        for p in (sender, keeper):
            p.start()
            p.set_peers({0: ("127.0.0.1", keeper.port), 1: ("127.0.0.1", sender.port)}, hosting={0, 1})
        state = _state(size_mb, 0)
        floor = {k: torch.empty_like(v) for k, v in state.items()}
        for k in floor:
            floor[k].copy_(state[k])  # touched
        for step in range(repeats + 1):  # the first round grows and touches the slots: not counted
            for t in state.values():
                t.add_(1.0)
            w0, c0 = time.perf_counter(), time.process_time()
            for k in floor:
                floor[k].copy_(state[k])
            w1, c1 = time.perf_counter(), time.process_time()
            writer.write(step, state)
            writer.flush()
            w2, c2 = time.perf_counter(), time.process_time()
            before = sender.stats["bytes_sent"]
            assert sender.send_round() == 1, "the copy was refused"
            w3, c3 = time.perf_counter(), time.process_time()
            if step:
                nbytes = sum(v.numel() * 4 for v in state.values())
                rows["floor_copy"].append((w1 - w0, c1 - c0, 0))
                rows["local_snapshot"].append((w2 - w1, c2 - c1, 0))
                rows["peer_copy"].append((w3 - w2, c3 - c2, sender.stats["bytes_sent"] - before))
    finally:
        writer.close()
        for p in (sender, keeper):
            p.stop()
        remove_job(shm, job)
    out = []
    for name, samples in rows.items():
        wall = statistics.median(s[0] for s in samples)
        row = {"name": f"{name}_{size_mb}mb", "state_bytes": size_mb << 20, "wall_s": round(wall, 5),
               "cpu_s": round(statistics.median(s[1] for s in samples), 5),
               "wall_min_s": round(min(s[0] for s in samples), 5), "wall_max_s": round(max(s[0] for s in samples), 5),
               "throughput_bytes_per_s": round((size_mb << 20) / wall)}
        if name == "peer_copy":
            row["network_bytes"] = samples[-1][2]
        out.append(row)
    return out


def train_once(peer: bool, steps: int, tmp: Path) -> dict:
    """The example on two local agents, one rank each; median step_s from node 0's event log."""
    port, job = runlib.free_port(), f"pm{uuid.uuid4().hex[:6]}"
    env = dict(os.environ, UNBROKEN_JOB_SECRET=SECRET.decode())
    script = [str(runlib.REPO / "examples" / "train_gpt.py"), "--steps", str(steps),
              "--out", str(tmp / f"{job}.safetensors"), "--optimizer", "plain"]
    shm_dirs, procs = [], []
    started = time.monotonic()
    try:
        for node in (0, 1):
            shm = Path(tempfile.mkdtemp(prefix=f"{job}-n{node}-", dir="/dev/shm"))
            shm_dirs.append(shm)
            cmd = [sys.executable, "-m", "unbroken.cli.main", "run", "--nnodes", "2", "--node-rank", str(node),
                   "--nproc-per-node", "1",
                   "--master-addr", "127.0.0.1", "--master-port", str(port), "--rdzv-id", job,
                   "--run-dir", str(tmp / f"{job}-node{node}"), "--shm-dir", str(shm), "--save", str(tmp / job),
                   "--persist-every-steps", "0", *([] if peer else ["--no-peer-memory"]), *script]
            procs.append(subprocess.Popen(cmd, env=env, cwd=runlib.REPO, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, start_new_session=True))
            runlib.in_flight.append(procs[-1])
            time.sleep(0.5 if node == 0 else 0)
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            runlib.kill_tree(p)
        for shm in shm_dirs:
            shutil.rmtree(shm, ignore_errors=True)
    events = runlib.read_events(tmp / f"{job}-node0")
    steps_s = [e["step_s"] for e in events if e["event"] == "step" and e.get("step", 0) > 2]
    return {"rc": codes, "step_s": statistics.median(steps_s) if steps_s else None,
            "job_s": time.monotonic() - started}


def train_rows(steps: int, repeats: int) -> list[dict]:
    runs: dict[bool, list[dict]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(repeats):
            for peer in (True, False):
                runs[peer].append(train_once(peer, steps, Path(tmp)))
    rows = []
    for peer, results in runs.items():
        ok = [r for r in results if r["rc"] == [0, 0] and r["step_s"] is not None]
        rows.append({"name": "train_with_peer_memory" if peer else "train_without_peer_memory",
                     "runs_ok": len(ok), "runs": len(results),
                     "step_s": round(statistics.median(r["step_s"] for r in ok), 5) if ok else None,
                     "job_s": round(statistics.median(r["job_s"] for r in ok), 3) if ok else None})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--train-steps", type=int, default=30, help="0: skip the training rows")
    ap.add_argument("--train-repeats", type=int, default=2)
    ap.add_argument("--shm-dir", default="/dev/shm")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args()
    rows = [r for size in args.size_mb for r in copy_rows(size, args.repeats, Path(args.shm_dir))]
    if args.train_steps:
        rows += train_rows(args.train_steps, args.train_repeats)
    keys = ["wall_s", "cpu_s", "network_bytes", "throughput_bytes_per_s", "step_s", "job_s"]
    print(f"{'row':<30}" + "".join(f"{k:>24}" for k in keys))
    for r in rows:
        print(f"{r['name']:<30}" + "".join(f"{str(r.get(k, '')):>24}" for k in keys))
    by = {r["name"]: r for r in rows}
    for size in args.size_mb:
        peer, local = by[f"peer_copy_{size}mb"], by[f"local_snapshot_{size}mb"]
        print(f"{size} MiB: a peer copy costs {peer['wall_s'] / local['wall_s']:.2f}x the local snapshot's time, "
              f"{peer['network_bytes'] / (size << 20):.4f} bytes on the network per byte of state")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "benchmark": "peer_memory", "params": vars(args),
            "machine": {"cpus": os.cpu_count(), "torch": torch.__version__}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
