"""Launch real gloo ranks for the optim tests: one process per rank, a TCPStore hosted here.

The test process hosts the store (as the controller would), so no rank owns rendezvous and
no fixed port is used: the store binds port 0 and the ranks are told the port it got.
Every child is killed and reaped when the launch ends, whatever happened.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

WORKER = Path(__file__).with_name("optim_worker.py")
REPO = Path(__file__).resolve().parents[2]


def load_result(out_dir: Path, rank: int) -> dict:
    return torch.load(out_dir / f"rank{rank}.pt", weights_only=True)


def run_ranks(scenario: str, world_size: int, out_dir: Path, *, timeout_s: float = 90,
              while_running: Callable[[list[subprocess.Popen]], None] | None = None,
              expect_killed: tuple[int, ...] = ()) -> list[dict | None]:
    """Run ``scenario`` of optim_worker.py on ``world_size`` ranks; return each rank's result.

    ``while_running(procs)`` runs in this process once all ranks have started; ranks in
    ``expect_killed`` may die by signal (their result is None).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        for rank in range(world_size):
            log = open(out_dir / f"rank{rank}.log", "w")  # noqa: SIM115 - closed in finally
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, str(WORKER), scenario, str(rank), str(world_size), str(store.port), str(out_dir)],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO))
        if while_running is not None:
            while_running(procs)
        deadline = time.monotonic() + timeout_s
        for rank, proc in enumerate(procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"rank {rank} of scenario {scenario!r} still running after {timeout_s} s:\n"
                                     f"{_tail(out_dir, rank)}") from None
        for rank, proc in enumerate(procs):
            if rank not in expect_killed and proc.returncode != 0:
                raise AssertionError(f"rank {rank} of scenario {scenario!r} exited with {proc.returncode}:\n"
                                     f"{_tail(out_dir, rank)}")
        return [None if rank in expect_killed else load_result(out_dir, rank) for rank in range(world_size)]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            proc.wait()
        for log in logs:
            log.close()
        del store


def _tail(out_dir: Path, rank: int) -> str:
    try:
        return (out_dir / f"rank{rank}.log").read_text()[-4000:]
    except OSError as err:
        return f"(no log: {err})"


def wait_for_files(paths: list[Path], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            missing = [str(p) for p in paths if not p.exists()]
            raise AssertionError(f"timed out after {timeout_s} s waiting for {missing}")
        time.sleep(0.01)
