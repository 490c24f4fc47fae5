"""Checkpoint benchmark: how long training is blocked, until durable, and to restore.

Compares the unbroken memory tier (+ the storage tier behind it) with a plain copy into
preallocated memory (the floor), torch.save, safetensors and DCP (save / async_save), on
one state of --size-mb MiB of float32 in ~30 tensors, in one run, interleaved per repeat.

    python benchmarks/checkpoint.py [--size-mb 1024] [--repeats 5] [--dir DIR] [--json PATH]
        [--persister-size-mb 256] [--persister-steps 10] [--persister-repeats 5]
        [--overlap-size-mb 256] [--overlap-steps 6] [--overlap-repeats 3]

Figures per row (median over repeats, min/max in the JSON):
  blocked_s          training blocked (ours: SnapshotWriter.write; DCP async: async_save)
  committed_s        ours: from write() until the snapshot is committed in shared memory
  durable_s          from the start until the bytes are fsynced on storage (ours: write,
                     commit in memory, then what the agent's persister does: read the
                     committed snapshot from shared memory, StorageTier.save_rank + commit)
  restore_memory_s   ours: SnapshotReader.load(into=state) (verified, in place into the
                     preallocated tensors of the state, as a restarted worker does after
                     building its model and optimizer)
  restore_memory_fresh_s  ours: SnapshotReader.load() (verified, into new tensors)
  restore_storage_s  ours: StorageTier.load_rank, page cache dropped first
  restore_s          the others' load (page cache dropped first; DCP loads in place)
  clone_s            floor_copy row: clone() of the same tensors (allocate + copy), the
                     floor of any restore that returns new tensors (page faults included)
Snapshots are taken with a pause between them longer than their commit (as training
would, every N steps); back-to-back writes would also wait for the previous checksum.

Then the persister's cost to training (row train_step): a small CPU training loop (matmuls
over --persister-size-mb MiB of weights, updated in place) snapshots into shared memory
every step; its step time without (step_s) and with (step_with_persister_s) an agent's
Persister running in another process, writing every PERSIST_EVERY-th snapshot to storage
(niced, as in the agent), in alternating phases. persister_slowdown_ratio is their ratio;
steps whose snapshot was skipped (slots held or pinned for the persister) are left out of
it and counted in skipped_snapshot_steps.

Last, the overlapped snapshot in a training loop (benchmarks/snapshot_overlap.py): a model of
--overlap-size-mb MiB of weights + AdamW, a snapshot every step copied while the next forward
and backward run, settled before the update; training blocked per snapshot vs a plain copy_
and DCP async_save of the same state, and the loop's speed vs the same loop without snapshots.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path

import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp

from unbroken.agent.persister import Persister
from unbroken.checkpoint.memory import SnapshotWriter
from unbroken.checkpoint.memory_reader import SnapshotReader
from unbroken.checkpoint.shm_files import remove_job
from unbroken.checkpoint.storage import StorageTier
from unbroken.config import CheckpointConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
import snapshot_overlap  # noqa: E402  (a sibling script)

N_TENSORS = 30
SHM_DIR = Path("/dev/shm")
ROWS = ("floor_copy", "unbroken", "torch_save", "safetensors", "dcp_save", "dcp_async_save")
PERSIST_EVERY = 5  # persister phase: every 5th snapshot goes to storage
TRAIN_DIM, TRAIN_BATCH = 4096, 128  # persister phase: 64 MiB weight matrices, batch rows


def make_state(size_mb: int, device: torch.device) -> dict:
    numel = size_mb * (1 << 20) // 4 // N_TENSORS
    g = torch.Generator().manual_seed(0)
    model = {f"layers.{i}.weight": torch.rand(numel, generator=g).to(device) for i in range(N_TENSORS)}
    return {"model": model, "step": 0}


def host_buffer(t: torch.Tensor) -> torch.Tensor:
    """Where a copy of ``t`` lands on the host: pinned memory for a device tensor."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fsync_path(path: Path) -> None:
    """fsync a file, or every file of a directory tree and the directories themselves."""
    paths = [path] if path.is_file() else [*path.rglob("*"), path]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def drop_cache(path: Path) -> None:
    """Ask the kernel to drop `path`'s (clean, fsynced) pages from the page cache."""
    for p in ([path] if path.is_file() else [q for q in path.rglob("*") if q.is_file()]):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_bytes(path: Path) -> int | None:
    """Bytes of `path`'s files still in the page cache (util-linux fincore), None if unknown."""
    files = [str(path)] if path.is_file() else [str(q) for q in path.rglob("*") if q.is_file()]
    try:
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *files],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return sum(int(line) for line in out.split())
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


class Bench:
    """Runs each method once per repeat and collects {row: {figure: [seconds...]}}."""

    def __init__(self, state: dict, root: Path, job_id: str) -> None:
        self.state, self.root, self.job_id = state, root, job_id
        self.tensors = list(state["model"].values())
        self.device = self.tensors[0].device
        self.figures: dict[str, dict[str, list[float]]] = {r: {} for r in ROWS}
        self.resident_after_drop: list[int] = []
        # The floor: a copy into preallocated host memory (pinned for device tensors).
        self.floor_dst = [host_buffer(t) for t in self.tensors]
        for d, t in zip(self.floor_dst, self.tensors):  # touch + warm
            d.zero_()
            d.copy_(t)
        # What a restarted worker restores into: its freshly built (touched) state.
        self.into = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
                     "step": 0}
        self.writer = SnapshotWriter(SHM_DIR, job_id, 0)
        self.reader = SnapshotReader(SHM_DIR, job_id, 0)
        self.tier = StorageTier(root / "unbroken", keep=1)
        for step in (1, 2):  # allocate and pre-touch both slots once, as a job does at start
            self.writer.write(step, state)
            self.writer.flush()
        self.step = 2

    def add(self, row: str, **figures: float) -> None:
        for key, value in figures.items():
            self.figures[row].setdefault(key, []).append(value)

    def cold(self, path: Path) -> None:
        drop_cache(path)
        left = resident_bytes(path)
        if left is not None:
            self.resident_after_drop.append(left)

    def floor_copy(self) -> None:
        start = time.perf_counter()
        for d, t in zip(self.floor_dst, self.tensors):
            d.copy_(t, non_blocking=True)
        sync(self.device)
        blocked = time.perf_counter() - start
        start = time.perf_counter()
        clones = [t.clone() for t in self.tensors]  # the floor of a restore into new tensors
        clone = time.perf_counter() - start
        del clones
        self.add("floor_copy", blocked_s=blocked, clone_s=clone)

    def unbroken(self) -> None:
        self.floor_copy()  # right before ours (A B): the ratio that matters, measured paired
        self.step += 1
        self.state["step"] = self.step
        start = time.perf_counter()
        blocked = self.writer.write(self.step, self.state, meta={"step": self.step})
        self.writer.flush()
        committed = time.perf_counter() - start
        persist_start = time.perf_counter()
        snapshot, meta = self.reader.load()  # the agent's persister, in the background
        self.tier.save_rank(self.step, 0, 1, snapshot, meta=meta)
        self.tier.commit(self.step, 1)
        durable = committed + time.perf_counter() - persist_start
        del snapshot
        time.sleep(0.2)
        first = self.into["model"]["layers.0.weight"]
        first.fill_(-1.0)  # proves the restore wrote it
        start = time.perf_counter()
        restored, _ = self.reader.load(into=self.into)
        restore_memory = time.perf_counter() - start
        assert restored["model"]["layers.0.weight"] is first and torch.equal(first, self.tensors[0])
        start = time.perf_counter()
        restored, _ = self.reader.load()
        restore_fresh = time.perf_counter() - start
        assert torch.equal(restored["model"]["layers.0.weight"], self.tensors[0].cpu())  # new tensors: on the host
        del restored
        self.cold(self.tier.root)
        start = time.perf_counter()
        restored, _ = self.tier.load_rank(self.step, 0)
        restore_storage = time.perf_counter() - start
        del restored
        self.add("unbroken", blocked_s=blocked, committed_s=committed, durable_s=durable,
                 persist_s=durable - committed, restore_memory_s=restore_memory,
                 restore_memory_fresh_s=restore_fresh, restore_storage_s=restore_storage)

    def torch_save(self) -> None:
        path = self.root / "torch_save.pt"
        start = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(self.state, f)
            f.flush()
            os.fsync(f.fileno())
        durable = time.perf_counter() - start
        self.cold(path)
        start = time.perf_counter()
        loaded = torch.load(path, weights_only=True, map_location=self.device)
        sync(self.device)
        restore = time.perf_counter() - start
        del loaded
        path.unlink()
        self.add("torch_save", blocked_s=durable, durable_s=durable, restore_s=restore)

    def safetensors(self) -> None:
        path = self.root / "model.safetensors"
        start = time.perf_counter()
        safetensors.torch.save_file(self.state["model"], str(path))
        fsync_path(path)
        durable = time.perf_counter() - start
        self.cold(path)
        start = time.perf_counter()
        loaded = safetensors.torch.load_file(str(path), device=str(self.device))
        sync(self.device)
        restore = time.perf_counter() - start
        del loaded
        path.unlink()
        self.add("safetensors", blocked_s=durable, durable_s=durable, restore_s=restore)

    def _dcp_restore(self, path: Path) -> float:
        target = {"model": {k: torch.empty_like(v) for k, v in self.state["model"].items()},
                  "step": 0}
        for t in target["model"].values():
            t.zero_()  # DCP loads in place into preallocated tensors: not counted here
        self.cold(path)
        start = time.perf_counter()
        dcp.load(target, storage_reader=dcp.FileSystemReader(str(path)))
        return time.perf_counter() - start

    def dcp_save(self) -> None:
        path = self.root / "dcp"
        start = time.perf_counter()
        dcp.save(self.state, storage_writer=dcp.FileSystemWriter(str(path), thread_count=2))
        durable = time.perf_counter() - start
        restore = self._dcp_restore(path)
        shutil.rmtree(path)
        self.add("dcp_save", blocked_s=durable, durable_s=durable, restore_s=restore)

    def dcp_async_save(self) -> None:
        path = self.root / "dcp_async"
        start = time.perf_counter()
        future = dcp.async_save(self.state,
                                storage_writer=dcp.FileSystemWriter(str(path), thread_count=2))
        blocked = time.perf_counter() - start
        future.result()
        durable = time.perf_counter() - start
        restore = self._dcp_restore(path)
        shutil.rmtree(path)
        self.add("dcp_async_save", blocked_s=blocked, durable_s=durable, restore_s=restore)

    def close(self) -> None:
        self.writer.close()


def _persister_main(conn, shm_dir: str, job_id: str, save_dir: str, every: int) -> None:
    """Child process, an agent: on "start" runs a Persister for rank 0 of `job_id` (committing
    each step it persists: the controller's part), on "stop" stops it; replies with the
    number of steps persisted so far; returns on "exit"."""
    ckpt = CheckpointConfig(save_dir=save_dir, every_steps=1, persist_every_steps=every,
                            keep=1, shm_dir=shm_dir)
    tier, persisted, persister = StorageTier(save_dir, keep=1), [0], None

    def report(step: int, ranks: list[int], seconds: float, error: str) -> None:
        if not error:
            tier.commit(step, 1)
            persisted[0] += 1

    while (command := conn.recv()) != "exit":
        if command == "start":
            persister = Persister(ckpt, job_id, lambda: 1, lambda: [0], report, poll_s=0.05)
            persister.start()
        elif persister is not None:
            persister.stop()  # persists the newest due snapshot first: outside the timing
            persister = None
        conn.send(persisted[0])


class PersisterBench:
    """Step time of a small training loop that snapshots every step, without and with an
    agent process's Persister writing every PERSIST_EVERY-th snapshot to storage.

    Figures {step_s, step_with_persister_s: [seconds...]} count only steps whose snapshot
    was written: a snapshot skipped because both slots are held for the persister makes a
    step cheaper, which would hide the persister's cost; those are counted apart.
    """

    def __init__(self, size_mb: int, steps: int, root: Path, job_id: str) -> None:
        n = max(1, size_mb * (1 << 20) // (4 * TRAIN_DIM * TRAIN_DIM))
        g = torch.Generator().manual_seed(1)
        self.weights = {f"w{i}": torch.randn(TRAIN_DIM, TRAIN_DIM, generator=g) / TRAIN_DIM ** 0.5
                        for i in range(n)}
        self.x = torch.randn(TRAIN_BATCH, TRAIN_DIM, generator=g)
        self.steps, self.step = steps, 0
        self.jobs = {"plain": f"{job_id}-p0", "persisted": f"{job_id}-p1"}
        # Without a persister nothing is held; with one, every PERSIST_EVERY-th snapshot is
        # held until persisted, as the worker's writer does under `unbroken run`.
        self.writers = {"plain": SnapshotWriter(SHM_DIR, self.jobs["plain"], 0),
                        "persisted": SnapshotWriter(SHM_DIR, self.jobs["persisted"], 0,
                                                    hold_every=PERSIST_EVERY)}
        self.figures: dict[str, list[float]] = {"step_s": [], "step_with_persister_s": []}
        self.persisted_steps, self.skipped_snapshot_steps = 0, 0
        ctx = multiprocessing.get_context("spawn")  # an agent is another process
        self.conn, child_conn = ctx.Pipe()
        self.child = ctx.Process(target=_persister_main, daemon=True, args=(
            child_conn, str(SHM_DIR), self.jobs["persisted"], str(root / "persister"),
            PERSIST_EVERY))
        self.child.start()
        try:
            for name in self.writers:  # allocate and touch the slots, warm up the matmuls
                self.run(name, 3)
        except BaseException:
            self.close()
            raise

    def run(self, name: str, steps: int) -> list[float]:
        """Train `steps` steps, a snapshot each; the times of those whose snapshot was written."""
        times, writer = [], self.writers[name]
        for _ in range(steps):
            self.step += 1
            skipped = writer.skipped_writes
            start = time.perf_counter()
            h = self.x
            for w in self.weights.values():
                h = torch.tanh(h @ w)
            for w in self.weights.values():  # an in-place update: every snapshot differs
                w.mul_(1.0 - 1e-6 * float(h[0, 0]))
            writer.write(self.step, {"model": self.weights, "step": self.step})
            if writer.skipped_writes == skipped:
                times.append(time.perf_counter() - start)
            else:
                self.skipped_snapshot_steps += 1
        return times

    def phase(self, with_persister: bool) -> None:
        if not with_persister:
            self.figures["step_s"].extend(self.run("plain", self.steps))
            return
        self._ask("start")
        try:
            self.figures["step_with_persister_s"].extend(self.run("persisted", self.steps))
        finally:
            self.persisted_steps = self._ask("stop")

    def _ask(self, command: str) -> int:
        self.conn.send(command)
        if not self.conn.poll(300):
            raise RuntimeError(f"the persister process did not answer {command!r} in 300 s")
        return self.conn.recv()

    def close(self) -> None:
        if self.child.is_alive():
            self.conn.send("exit")
            self.child.join(60)
            if self.child.is_alive():
                self.child.kill()
                self.child.join()
        for name, writer in self.writers.items():
            writer.close()
            remove_job(SHM_DIR, self.jobs[name])


def summarize(figures: dict[str, dict[str, list[float]]]) -> list[dict]:
    rows = []
    for name in figures:
        row: dict = {"name": name}
        for key, values in figures[name].items():
            if not values:
                continue
            row[key] = round(statistics.median(values), 4)
            row[key.removesuffix("_s") + "_min_s"] = round(min(values), 4)
            row[key.removesuffix("_s") + "_max_s"] = round(max(values), 4)
        rows.append(row)
    return rows


def ratios(rows: list[dict], figures: dict[str, dict[str, list[float]]]) -> dict[str, float]:
    by = {r["name"]: r for r in rows}
    ours = by["unbroken"]
    out = {}
    for name in ROWS[:1] + ROWS[2:]:
        other = by[name]
        out[f"blocked_vs_{name}_ratio"] = ours["blocked_s"] / other["blocked_s"]
        if "durable_s" in other:
            out[f"durable_vs_{name}_ratio"] = ours["durable_s"] / other["durable_s"]
        if "restore_s" in other:
            out[f"restore_memory_vs_{name}_ratio"] = ours["restore_memory_s"] / other["restore_s"]
            out[f"restore_storage_vs_{name}_ratio"] = ours["restore_storage_s"] / other["restore_s"]
    out["blocked_vs_floor_copy_paired_ratio"] = statistics.median(
        u / f for u, f in zip(figures["unbroken"]["blocked_s"], figures["floor_copy"]["blocked_s"]))
    floor = by["floor_copy"]
    out["restore_memory_vs_floor_copy_ratio"] = ours["restore_memory_s"] / floor["blocked_s"]
    out["restore_memory_vs_floor_copy_paired_ratio"] = statistics.median(
        u / f for u, f in zip(figures["unbroken"]["restore_memory_s"],
                              figures["floor_copy"]["blocked_s"]))
    out["restore_memory_fresh_vs_clone_ratio"] = ours["restore_memory_fresh_s"] / floor["clone_s"]
    if "step_with_persister_s" in by.get("train_step", {}) and "step_s" in by["train_step"]:
        out["persister_slowdown_ratio"] = \
            by["train_step"]["step_with_persister_s"] / by["train_step"]["step_s"]
    return {k: round(v, 3) for k, v in out.items()}


def fmt(row: dict, key: str) -> str:
    if key not in row:
        return "-"
    lo, hi = row[key.removesuffix("_s") + "_min_s"], row[key.removesuffix("_s") + "_max_s"]
    return f"{row[key]:.3f} [{lo:.3f}-{hi:.3f}]"


def print_table(rows: list[dict], r: dict[str, float], params: dict, cold: str) -> None:
    cols = ("blocked_s", "committed_s", "durable_s", "restore_memory_s",
            "restore_memory_fresh_s", "restore_storage_s", "restore_s", "clone_s")
    print(f"\ncheckpoint benchmark: {params['size_mb']} MiB fp32 in {N_TENSORS} tensors, "
          f"{params['repeats']} repeats, median [min-max] seconds; storage reads: {cold}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus")
    width = 24
    print(f"{'row':<15}" + "".join(f"{c:>{width}}" for c in cols))
    for row in rows:
        if row["name"] in ROWS:
            print(f"{row['name']:<15}" + "".join(f"{fmt(row, c):>{width}}" for c in cols))
    print("\nours / baseline (blocked, durable, restore: memory | storage)")
    for name in ROWS[:1] + ROWS[2:]:
        parts = [f"blocked {r[f'blocked_vs_{name}_ratio']:.2f}x"]
        if f"durable_vs_{name}_ratio" in r:
            parts.append(f"durable {r[f'durable_vs_{name}_ratio']:.2f}x")
        if f"restore_storage_vs_{name}_ratio" in r:
            parts.append(f"restore {r[f'restore_memory_vs_{name}_ratio']:.2f}x | "
                         f"{r[f'restore_storage_vs_{name}_ratio']:.2f}x")
        print(f"  vs {name:<15} " + ", ".join(parts))
    checks = [("blocked <= 1.5 x floor_copy", r["blocked_vs_floor_copy_ratio"], 1.5),
              ("  same, median of per-repeat ratios", r["blocked_vs_floor_copy_paired_ratio"], 1.5),
              ("blocked <= 0.3 x dcp_async_save", r["blocked_vs_dcp_async_save_ratio"], 0.3),
              ("restore from memory <= 2 x floor_copy", r["restore_memory_vs_floor_copy_ratio"],
               2.0),
              ("  same, median of per-repeat ratios",
               r["restore_memory_vs_floor_copy_paired_ratio"], 2.0),
              ("(fresh restore vs clone: info)", r["restore_memory_fresh_vs_clone_ratio"], 2.0)]
    train = next((row for row in rows if row["name"] == "train_step"), None)
    if train is not None:
        print(f"\npersister: {params['persister_size_mb']} MiB trained on, a snapshot every step, "
              f"every {PERSIST_EVERY}th persisted; step time median [min-max] s")
        print(f"  without {fmt(train, 'step_s')}   with {fmt(train, 'step_with_persister_s')}   "
              f"({train['persisted_steps']} steps persisted, "
              f"{train['skipped_snapshot_steps']} snapshots skipped: slots held or pinned for it)")
        if "persister_slowdown_ratio" in r:
            checks.append(("persister slows training <= 1.05 x", r["persister_slowdown_ratio"],
                           1.05))
    print("\ntargets")
    for what, value, limit in checks:
        print(f"  {what:<40} {value:6.3f}x  {'met' if value <= limit else 'NOT met'}")


def main() -> None:
    snapshot_overlap.exit_on_sigterm()  # the snapshot files go with a `timeout` too
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None,
                        help="storage directory (default: a temp dir on disk, not /dev/shm)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--device", default="cpu",
                        help="where the state lives: cpu, or cuda (staged device -> pinned host -> shm)")
    parser.add_argument("--persister-size-mb", type=int, default=256,
                        help="weights of the persister-slowdown training loop (0: skip it)")
    parser.add_argument("--persister-steps", type=int, default=10,
                        help="training steps per phase (without / with the persister)")
    parser.add_argument("--persister-repeats", type=int, default=5,
                        help="pairs of phases (without, with), alternating")
    parser.add_argument("--overlap-size-mb", type=int, default=256,
                        help="weights of the overlapped-snapshot training loop (0: skip it)")
    parser.add_argument("--overlap-steps", type=int, default=6, help="steps per mode and repeat")
    parser.add_argument("--overlap-repeats", type=int, default=3, help="repeats of (none, overlap, boundary)")
    args = parser.parse_args()
    if args.overlap_size_mb < 0 or args.overlap_steps < 1 or args.overlap_repeats < 1:
        parser.error("--overlap-size-mb must be >= 0, --overlap-steps and --overlap-repeats >= 1")
    if args.size_mb < 1 or args.repeats < 1:
        parser.error("--size-mb and --repeats must be >= 1")
    if args.persister_size_mb < 0 or args.persister_steps < 1 or args.persister_repeats < 1:
        parser.error("--persister-size-mb must be >= 0, --persister-steps and "
                     "--persister-repeats >= 1")
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    # Skipped snapshots (both slots held for the persister) are counted and printed instead.
    logging.getLogger("unbroken.checkpoint.memory").setLevel(logging.ERROR)
    base = args.dir or Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="unbroken-bench-", dir=base))
    job_id = f"bench-{uuid.uuid4().hex[:8]}"
    bench, persister, load_start = None, None, list(os.getloadavg())  # other work skews times
    try:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device here")
        state = make_state(args.size_mb, device)
        bench = Bench(state, root, job_id)
        for _ in range(args.repeats):  # interleaved: each method once per repeat
            for name in ROWS[1:]:  # floor_copy runs inside unbroken(), just before the write
                getattr(bench, name)()
                time.sleep(0.5)
        bench.close()
        if args.persister_size_mb:
            persister = PersisterBench(args.persister_size_mb, args.persister_steps, root, job_id)
            for _ in range(args.persister_repeats):  # A B A B
                persister.phase(with_persister=False)
                persister.phase(with_persister=True)
            bench.figures["train_step"] = persister.figures
        rows = summarize(bench.figures)
        if persister is not None:
            rows[-1].update(persisted_steps=persister.persisted_steps,
                            skipped_snapshot_steps=persister.skipped_snapshot_steps)
        r = ratios(rows, bench.figures)
        res = bench.resident_after_drop
        cold = ("cold (fadvise DONTNEED; fincore: "
                f"{max(res) if res else '?'} bytes still cached at most)" if res else
                "fadvise DONTNEED asked, residency unknown (no fincore)")
        params = {"size_mb": args.size_mb, "repeats": args.repeats, "tensors": N_TENSORS, "device": args.device,
                  "storage_dir": str(base), "shm_dir": str(SHM_DIR), "storage_reads": cold,
                  "persister_size_mb": args.persister_size_mb,
                  "persister_steps": args.persister_steps,
                  "persister_repeats": args.persister_repeats, "persist_every": PERSIST_EVERY}
        machine = {"cpus": os.cpu_count(), "torch": torch.__version__,
                   "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
                   "platform": platform.platform(), "loadavg_start": load_start,
                   "loadavg_end": list(os.getloadavg())}
        print_table(rows, r, params, cold)
        overlap = None
        if args.overlap_size_mb:
            overlap = snapshot_overlap.measure(args.overlap_size_mb, args.overlap_steps, args.overlap_repeats,
                                               2, SHM_DIR, root)
            snapshot_overlap.print_result(overlap, args.overlap_size_mb, args.overlap_steps, args.overlap_repeats)
        if args.json:
            args.json.write_text(json.dumps({"benchmark": "checkpoint", "params": params,
                                             "machine": machine, "rows": rows, "ratios": r,
                                             "overlap": overlap}, indent=1) + "\n")
    finally:
        if bench is not None:
            bench.close()
        if persister is not None:
            persister.close()
        remove_job(SHM_DIR, job_id)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
