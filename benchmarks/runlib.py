"""What the launcher benchmarks share: running one launcher, its event log, its weights, its /dev/shm.

Used by benchmarks/recovery.py and benchmarks/scale.py (scripts, run from the repository as
`python benchmarks/<name>.py`, so this module is importable as `runlib`). Each launcher runs in
its own session with its output stamped (time.time()) line by line as it arrives; nothing it
started is left behind (its process group and every descendant are SIGKILLed, each by pid).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Launch:
    rc: int | None
    lines: list[tuple[float, str]]
    job_s: float
    timed_out: bool


in_flight: list[subprocess.Popen] = []  # the launcher in flight, for the interrupt path


def kill_tree(popen: subprocess.Popen) -> None:
    """SIGKILL the launcher's process group and every descendant (workers run in their own
    sessions under both launchers), each by its pid."""
    try:
        descendants = psutil.Process(popen.pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    try:
        os.killpg(popen.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for child in descendants:
        try:
            child.kill()
        except psutil.Error:
            pass
    try:
        popen.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    psutil.wait_procs(descendants, timeout=10)


def launch(cmd: list[str], env: dict[str, str], timeout_s: float, echo: bool,
           on_line: Callable[[float, str], None] | None = None) -> Launch:
    """Run ``cmd`` until it exits or ``timeout_s`` passes; ``on_line(t, text)`` is called in the
    reader thread for every output line as it arrives (a benchmark injecting its own fault)."""
    lines: list[tuple[float, str]] = []
    t0 = time.time()
    popen = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
    in_flight.append(popen)

    def read() -> None:
        assert popen.stdout is not None
        for raw in iter(popen.stdout.readline, b""):
            t = time.time()
            text = raw.decode(errors="replace").rstrip("\n")
            lines.append((t, text))
            if on_line is not None:
                on_line(t, text)
            if echo:
                print(f"    | {text}", flush=True)
        popen.stdout.close()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    timed_out = False
    try:
        try:
            popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        t1 = time.time()
    finally:
        if popen.poll() is None:
            kill_tree(popen)
        else:  # the leader is gone; anything left in its group goes too
            try:
                os.killpg(popen.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        in_flight.remove(popen)
    reader.join(timeout=10)
    return Launch(rc=None if timed_out else popen.returncode, lines=lines, job_s=t1 - t0,
                  timed_out=timed_out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unbroken_cmd() -> list[str]:
    script = Path(sys.executable).parent / "unbroken"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from unbroken.cli.main import main; sys.exit(main())"]


def read_events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return events


def weights_equal(path: Path, reference: dict) -> bool:
    from safetensors.torch import load_file
    import torch

    got = load_file(str(path))
    return got.keys() == reference.keys() and all(torch.equal(got[k], reference[k]) for k in got)


def clean_shm(run_dir: Path) -> list[str]:
    """Remove shared-memory files left by this run's unbroken job (only its own job id)."""
    removed: list[str] = []
    config = run_dir / "config.node0.json"
    try:
        job_id = json.loads(config.read_text()).get("job_id", "")
    except (OSError, json.JSONDecodeError):
        return removed
    if not job_id:
        return removed
    for path in Path("/dev/shm").glob(f"unbroken-{job_id}*"):
        try:
            path.unlink()
            removed.append(path.name)
        except OSError:
            pass
    return removed


def median(values: list[float]) -> float:
    return statistics.median(values)


def worker_pid(run_dir: Path, rank: int) -> int | None:
    """The pid of ``rank``'s newest worker process, from the run's ``rank_started`` events."""
    pids = [ev["pid"] for ev in read_events(run_dir) if ev.get("event") == "rank_started" and ev.get("rank") == rank]
    return int(pids[-1]) if pids else None


def run_tree_driver(src: Path, driver: str, argv: list[str], timeout_s: float, label: str,
                    also_path: list[Path] = ()) -> object | None:
    """Run ``driver`` (Python source) with ``argv`` in a fresh interpreter against the source tree
    ``src`` (its working directory, first on PYTHONPATH; then ``also_path``); the last line it printed,
    as JSON. None, with why on stderr, when it failed or ran past ``timeout_s`` (the before/ours rows of
    controller_scale.py and durable_growth.py)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in [src, *also_path]))
    try:
        out = subprocess.run([sys.executable, "-c", driver, *argv], env=env, cwd=src, capture_output=True,
                             text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"  {label} ({src}): over {timeout_s:g} s, left out", file=sys.stderr)
        return None
    if out.returncode != 0:
        print(f"  {label} ({src}) failed:\n{out.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])
