"""The controller of the standalone data-parallel job in tests/parallel: start, watch, replace.

Hosts the TCPStore (so no rank's death takes rendezvous with it), starts ``world`` ranks of
:mod:`tests.parallel.dp_worker`, and when a rank dies: reaps it (fencing: it is dead before
anything is published), sets ``abort/<gen>`` to the lost ranks and starts the replacement for
generation ``gen + 1``. Returns each rank's facts and final parameters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tests.conftest import REPO, free_port

WORKER = Path(__file__).with_name("dp_worker.py")


@dataclass
class JobResult:
    facts: dict[int, dict]
    weights: dict[int, dict[str, torch.Tensor]]
    spawned_pids: dict[int, list[int]] = field(default_factory=dict)
    replace_s: list[float] = field(default_factory=list)


def run_job(out: Path, *, world: int = 4, steps: int = 8, kill: dict[int, int] | None = None,
            timeout_s: float = 120.0, extra: list[str] | None = None) -> JobResult:
    """Run the job; ``kill`` maps rank -> the step in whose backward that rank SIGKILLs itself."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=60),
                          wait_for_workers=False)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    procs: dict[int, subprocess.Popen] = {}
    pids: dict[int, list[int]] = {}
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)

    def start(rank: int, gen: int, kill_step: int) -> None:
        cmd = [sys.executable, "-X", "faulthandler", str(WORKER), "--rank", str(rank), "--world", str(world), "--port", str(port),
               "--steps", str(steps), "--gen", str(gen), "--out", str(out), "--kill-step", str(kill_step),
               *(extra or [])]
        log = open(logs / f"rank{rank}.gen{gen}.log", "w")
        procs[rank] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        pids.setdefault(rank, []).append(procs[rank].pid)

    for rank in range(world):
        start(rank, 0, (kill or {}).get(rank, -1))
    gen, deadline, replace_s = 0, time.monotonic() + timeout_s, []
    try:
        while any(p.poll() is None for p in procs.values()) or any(p.returncode != 0 for p in procs.values()):
            if time.monotonic() > deadline:
                raise AssertionError(f"job did not finish within {timeout_s} s\n{_tails(logs)}")
            dead = [r for r, p in procs.items() if p.poll() is not None and p.returncode != 0]
            if dead:
                bad = [r for r in dead if procs[r].returncode != -9]
                if bad:
                    raise AssertionError(f"rank(s) {bad} failed (exit {[procs[r].returncode for r in bad]})\n"
                                         f"{_tails(logs)}")
                t0 = time.monotonic()
                store.set(f"abort/{gen}", ",".join(map(str, dead)))
                gen += 1
                for rank in dead:
                    start(rank, gen, -1)
                replace_s.append(time.monotonic() - t0)
            time.sleep(0.005)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    facts = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(world)}
    weights = {r: torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(world)}
    return JobResult(facts, weights, pids, replace_s)


def _tails(logs: Path) -> str:
    return "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(logs.glob("*.log")))
