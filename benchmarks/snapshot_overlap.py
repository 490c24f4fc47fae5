"""The overlapped snapshot in a training loop (benchmarks/checkpoint.py runs it; or alone):

    python benchmarks/snapshot_overlap.py [--size-mb 256] [--steps 6] [--repeats 3] [--dcp-repeats 2]

A small CPU model (bias-free Linear layers of TRAIN_DIM x TRAIN_DIM fp32, --size-mb MiB of
weights, a BatchNorm1d whose running statistics every forward moves) trained with AdamW; the
state a snapshot copies is the session's tree of it (TrackedState: model, optimizer, RNG), so
parameters + 2x their size of optimizer state. Three modes, interleaved per repeat:

  none       no snapshot
  overlap    a snapshot every step: SnapshotWriter.write with the deferred tensors named by
             TrackedState.unchanged_until_update, settle() right before opt.step(), as a
             session does (the copy runs during the next forward and backward)
  boundary   a snapshot every step, all of it copied at the step boundary (as before)

Figures per mode: step_s (the whole step, snapshot included) and blocked_s (what the training
thread spent in write() plus settle()). Baselines on the same state: floor_copy_s, a copy_ of
every tensor of the tree into preallocated, touched memory; dcp_async_blocked_s, the time
torch.distributed.checkpoint.async_save blocks the caller. Printed, never asserted.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from unbroken.state.tree import flatten_state
from unbroken.checkpoint.memory import SnapshotWriter
from unbroken.checkpoint.shm_files import remove_job
from unbroken.worker.api import SessionHooks
from unbroken.worker.tracked import TrackedState

TRAIN_DIM, TRAIN_BATCH = 4096, 128
MODES = ("none", "overlap", "boundary")


class OverlapBench:
    """Owns the model, its optimizer, the tracked state and one writer per snapshot mode; runs in
    the calling thread (the writer's commit thread in the background)."""

    def __init__(self, size_mb: int, shm_dir: Path, job_id: str) -> None:
        layers = max(1, size_mb * (1 << 20) // (4 * TRAIN_DIM * TRAIN_DIM))
        torch.manual_seed(0)
        blocks: list[nn.Module] = []
        for _ in range(layers):
            blocks += [nn.Linear(TRAIN_DIM, TRAIN_DIM, bias=False), nn.Tanh()]
        self.model = nn.Sequential(nn.BatchNorm1d(TRAIN_DIM), *blocks)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(TRAIN_BATCH, TRAIN_DIM)
        self.tracked = TrackedState()
        hooks = SessionHooks(on_phase=lambda phase, step: None, should_abort=lambda: False, defer_completion=False)
        self.tracked.add("model", self.model, hooks)
        self.tracked.add("optimizer", self.opt, hooks)
        self.shm_dir, self.job_id, self.step = shm_dir, job_id, 0
        self.writers = {m: SnapshotWriter(shm_dir, f"{job_id}-{m}", 0) for m in MODES[1:]}
        self.figures: dict[str, list[float]] = {}
        self._floor_dst: list[torch.Tensor] | None = None
        try:
            for mode in MODES:  # warm up: AdamW's state appears, the slots are allocated and touched
                self.run(mode, 2, record=False)
        except BaseException:  # a SIGTERM (exit_on_sigterm) or an error: no snapshot file stays
            self.close()
            raise

    def add(self, key: str, value: float) -> None:
        self.figures.setdefault(key, []).append(value)

    def run(self, mode: str, steps: int, record: bool = True) -> None:
        writer = self.writers.get(mode)
        for _ in range(steps):
            start = time.perf_counter()
            loss = self.model(self.x).square().mean()
            loss.backward()
            blocked = 0.0
            if writer is not None:  # the update may change what the copy still reads
                t = time.perf_counter()
                writer.settle()
                blocked += time.perf_counter() - t
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.step += 1
            if writer is not None:
                tree = self.tracked.tree()
                deferred = self.tracked.unchanged_until_update(tree) if mode == "overlap" else ()
                blocked += writer.write(self.step, tree, {"step": self.step}, deferred=deferred)
            if record:
                self.add(f"{mode}_step_s", time.perf_counter() - start)
                if writer is not None:
                    self.add(f"{mode}_blocked_s", blocked)

    def floor_copy(self) -> None:
        tensors = list(flatten_state(self.tracked.tree())[0].values())
        if self._floor_dst is None:
            self._floor_dst = [torch.empty_like(t) for t in tensors]
            for d, t in zip(self._floor_dst, tensors):
                d.copy_(t)  # touched
        start = time.perf_counter()
        for d, t in zip(self._floor_dst, tensors):
            d.copy_(t)
        self.add("floor_copy_s", time.perf_counter() - start)
        self.add("state_bytes", float(sum(t.numel() * t.element_size() for t in tensors)))

    def dcp_async_blocked(self, root: Path) -> None:
        path = root / f"dcp-{self.step}"
        state = {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}
        start = time.perf_counter()
        future = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(str(path), thread_count=2))
        self.add("dcp_async_blocked_s", time.perf_counter() - start)
        future.result()
        shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        for mode, writer in self.writers.items():
            writer.close()
            remove_job(self.shm_dir, f"{self.job_id}-{mode}")


def measure(size_mb: int, steps: int, repeats: int, dcp_repeats: int, shm_dir: Path, root: Path) -> dict:
    """Interleaved repeats of every mode, then the baselines; {figure: median} plus ratios."""
    bench = OverlapBench(size_mb, shm_dir, f"bench-ov-{uuid.uuid4().hex[:8]}")
    try:
        for _ in range(repeats):
            for mode in MODES:
                bench.run(mode, steps)
            bench.floor_copy()
        for _ in range(dcp_repeats):
            bench.dcp_async_blocked(root)
    finally:
        bench.close()
    med = {k: statistics.median(v) for k, v in bench.figures.items()}
    med["speed_ratio"] = med["none_step_s"] / med["overlap_step_s"]
    med["boundary_speed_ratio"] = med["none_step_s"] / med["boundary_step_s"]
    med["blocked_vs_floor_copy_ratio"] = med["overlap_blocked_s"] / med["floor_copy_s"]
    if "dcp_async_blocked_s" in med:
        med["blocked_vs_dcp_async_ratio"] = med["overlap_blocked_s"] / med["dcp_async_blocked_s"]
    med["samples"] = {k: [round(x, 4) for x in v] for k, v in bench.figures.items() if k != "state_bytes"}
    return med


def print_result(r: dict, size_mb: int, steps: int, repeats: int) -> None:
    print(f"\nsnapshot overlap: {size_mb} MiB of weights + AdamW state ({r['state_bytes'] / (1 << 20):.0f} MiB "
          f"per snapshot), a snapshot every step, {steps} steps x {repeats} repeats per mode, medians; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus, {torch.get_num_threads()} torch threads")
    print(f"  step_s    none {r['none_step_s']:.4f}   overlap {r['overlap_step_s']:.4f}   "
          f"boundary {r['boundary_step_s']:.4f}")
    print(f"  blocked_s overlap {r['overlap_blocked_s']:.4f}   boundary {r['boundary_blocked_s']:.4f}   "
          f"floor copy_ {r['floor_copy_s']:.4f}   dcp async_save {r.get('dcp_async_blocked_s', float('nan')):.4f}")
    checks = [("overlap blocked <= 0.3 x copy_", r["blocked_vs_floor_copy_ratio"], 0.3, True)]
    if "blocked_vs_dcp_async_ratio" in r:
        checks.append(("overlap blocked <= 0.3 x dcp async_save", r["blocked_vs_dcp_async_ratio"], 0.3, True))
    checks += [("speed with a snapshot each step >= 0.97 x", r["speed_ratio"], 0.97, False),
               ("(boundary copy, before: speed)", r["boundary_speed_ratio"], 0.97, False)]
    for what, value, limit, at_most in checks:
        met = value <= limit if at_most else value >= limit
        print(f"  {what:<42} {value:6.3f}x  {'met' if met else 'NOT met'}")
    extra_s = r["overlap_step_s"] - r["none_step_s"]
    if extra_s > 0:  # the snapshot's cost is per byte of state; a step with more compute per byte hides more of it
        print(f"  a snapshot adds {extra_s * 1e3:.1f} ms to a {r['none_step_s'] * 1e3:.0f} ms step: a step of this state "
              f"taking >= {extra_s / (1 / 0.97 - 1):.2f} s (more tokens per step) runs at >= 0.97 x by that cost")


def exit_on_sigterm() -> None:
    """Make SIGTERM (a `timeout`, a scheduler's kill) exit through the `finally` blocks, which remove
    the snapshot files (up to GiBs of /dev/shm, i.e. RAM) this run made."""
    def _exit(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, _exit)


def main() -> None:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dcp-repeats", type=int, default=2)
    args = parser.parse_args()
    if min(args.size_mb, args.steps, args.repeats) < 1 or args.dcp_repeats < 0:
        parser.error("--size-mb, --steps, --repeats must be >= 1, --dcp-repeats >= 0")
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    root = Path(tempfile.mkdtemp(prefix="unbroken-bench-ov-"))
    try:
        r = measure(args.size_mb, args.steps, args.repeats, args.dcp_repeats, Path("/dev/shm"), root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_result(r, args.size_mb, args.steps, args.repeats)


if __name__ == "__main__":
    sys.exit(main())
