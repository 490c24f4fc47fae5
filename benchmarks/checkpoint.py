"""Checkpoint benchmark: how long training is blocked, until durable, and to restore.

Compares the unbroken memory tier (+ the storage tier behind it) with a plain copy into
preallocated memory (the floor), torch.save, safetensors and DCP (save / async_save), on
one state of --size-mb MiB of float32 in ~30 tensors, in one run, interleaved per repeat.

    python benchmarks/checkpoint.py [--size-mb 1024] [--repeats 5] [--dir DIR] [--json PATH]

Figures per row (median over repeats, min/max in the JSON):
  blocked_s          training blocked (ours: SnapshotWriter.write; DCP async: async_save)
  committed_s        ours: from write() until the snapshot is committed in shared memory
  durable_s          from the start until the bytes are fsynced on storage (ours: write,
                     commit in memory, then what the agent's persister does: read the
                     committed snapshot from shared memory, StorageTier.save_rank + commit)
  restore_memory_s   ours: SnapshotReader.load (verified, into fresh tensors)
  restore_storage_s  ours: StorageTier.load_rank, page cache dropped first
  restore_s          the others' load (page cache dropped first; DCP loads in place)
  clone_s            floor_copy row: clone() of the same tensors (allocate + copy), the
                     floor of any restore that returns new tensors (page faults included)
Snapshots are taken with a pause between them longer than their commit (as training
would, every N steps); back-to-back writes would also wait for the previous checksum.
"""

from __future__ import annotations

import argparse
import json
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

from unbroken.checkpoint.memory import SnapshotReader, SnapshotWriter
from unbroken.checkpoint.shm_files import remove_job
from unbroken.checkpoint.storage import StorageTier

N_TENSORS = 30
SHM_DIR = Path("/dev/shm")
ROWS = ("floor_copy", "unbroken", "torch_save", "safetensors", "dcp_save", "dcp_async_save")


def make_state(size_mb: int) -> dict:
    numel = size_mb * (1 << 20) // 4 // N_TENSORS
    g = torch.Generator().manual_seed(0)
    model = {f"layers.{i}.weight": torch.rand(numel, generator=g) for i in range(N_TENSORS)}
    return {"model": model, "step": 0}


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
        self.figures: dict[str, dict[str, list[float]]] = {r: {} for r in ROWS}
        self.resident_after_drop: list[int] = []
        self.floor_dst = [torch.empty_like(t) for t in self.tensors]
        for d, t in zip(self.floor_dst, self.tensors):  # touch + warm
            d.zero_()
            d.copy_(t)
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
            d.copy_(t)
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
        start = time.perf_counter()
        restored, _ = self.reader.load()
        restore_memory = time.perf_counter() - start
        assert torch.equal(restored["model"]["layers.0.weight"], self.tensors[0])
        del restored
        self.cold(self.tier.root)
        start = time.perf_counter()
        restored, _ = self.tier.load_rank(self.step, 0)
        restore_storage = time.perf_counter() - start
        del restored
        self.add("unbroken", blocked_s=blocked, committed_s=committed, durable_s=durable,
                 persist_s=durable - committed, restore_memory_s=restore_memory,
                 restore_storage_s=restore_storage)

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
        loaded = torch.load(path, weights_only=True)
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
        loaded = safetensors.torch.load_file(str(path))
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


def summarize(figures: dict[str, dict[str, list[float]]]) -> list[dict]:
    rows = []
    for name in ROWS:
        row: dict = {"name": name}
        for key, values in figures[name].items():
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
    out["restore_memory_vs_clone_ratio"] = ours["restore_memory_s"] / floor["clone_s"]
    return {k: round(v, 3) for k, v in out.items()}


def fmt(row: dict, key: str) -> str:
    if key not in row:
        return "-"
    lo, hi = row[key.removesuffix("_s") + "_min_s"], row[key.removesuffix("_s") + "_max_s"]
    return f"{row[key]:.3f} [{lo:.3f}-{hi:.3f}]"


def print_table(rows: list[dict], r: dict[str, float], params: dict, cold: str) -> None:
    cols = ("blocked_s", "committed_s", "durable_s", "restore_memory_s", "restore_storage_s",
            "restore_s", "clone_s")
    print(f"\ncheckpoint benchmark: {params['size_mb']} MiB fp32 in {N_TENSORS} tensors, "
          f"{params['repeats']} repeats, median [min-max] seconds; storage reads: {cold}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus")
    width = 22
    print(f"{'row':<15}" + "".join(f"{c:>{width}}" for c in cols))
    for row in rows:
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
              ("(restore from memory vs clone: info)", r["restore_memory_vs_clone_ratio"], 2.0)]
    print("\ntargets")
    for what, value, limit in checks:
        print(f"  {what:<40} {value:6.3f}x  {'met' if value <= limit else 'NOT met'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None,
                        help="storage directory (default: a temp dir on disk, not /dev/shm)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.size_mb < 1 or args.repeats < 1:
        parser.error("--size-mb and --repeats must be >= 1")
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    base = args.dir or Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="unbroken-bench-", dir=base))
    job_id = f"bench-{uuid.uuid4().hex[:8]}"
    bench, load_start = None, list(os.getloadavg())  # other work on the machine skews times
    try:
        state = make_state(args.size_mb)
        bench = Bench(state, root, job_id)
        for _ in range(args.repeats):  # interleaved: each method once per repeat
            for name in ROWS[1:]:  # floor_copy runs inside unbroken(), just before the write
                getattr(bench, name)()
                time.sleep(0.5)
        rows = summarize(bench.figures)
        r = ratios(rows, bench.figures)
        res = bench.resident_after_drop
        cold = ("cold (fadvise DONTNEED; fincore: "
                f"{max(res) if res else '?'} bytes still cached at most)" if res else
                "fadvise DONTNEED asked, residency unknown (no fincore)")
        params = {"size_mb": args.size_mb, "repeats": args.repeats, "tensors": N_TENSORS,
                  "storage_dir": str(base), "shm_dir": str(SHM_DIR), "storage_reads": cold}
        machine = {"cpus": os.cpu_count(), "torch": torch.__version__,
                   "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
                   "platform": platform.platform(), "loadavg_start": load_start,
                   "loadavg_end": list(os.getloadavg())}
        print_table(rows, r, params, cold)
        if args.json:
            args.json.write_text(json.dumps({"benchmark": "checkpoint", "params": params,
                                             "machine": machine, "rows": rows, "ratios": r},
                                            indent=1) + "\n")
    finally:
        if bench is not None:
            bench.close()
        remove_job(SHM_DIR, job_id)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
