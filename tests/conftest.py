"""Shared test helpers: free ports, running the CLI in a subprocess, and leak checks.

Every multi-process test must leave no process and no /dev/shm file of ours behind, even
when it fails: the autouse fixture below kills what a test left and fails the test.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train_gpt.py"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ours(proc: psutil.Process, marker: str) -> bool:
    try:
        env = proc.environ()
        cmd = " ".join(proc.cmdline())
    except (psutil.Error, OSError):
        return False
    return marker in env.get("UNBROKEN_RUN_DIR", "") or marker in cmd


def _shm_files() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if "unbroken" in n}
    except FileNotFoundError:
        return set()


@pytest.fixture(autouse=True)
def no_leftovers(tmp_path):
    """Fail a test that leaves processes or shared memory behind; clean up either way."""
    shm_before = _shm_files()
    yield
    me = psutil.Process()
    left = [p for p in me.children(recursive=True)]
    left += [p for p in psutil.process_iter() if p.pid != me.pid and p not in left and _ours(p, str(tmp_path))]
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=5)
    new_shm = _shm_files() - shm_before
    for name in new_shm:
        try:
            os.unlink(f"/dev/shm/{name}")
        except FileNotFoundError:
            pass
    assert not [p.pid for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], \
        f"processes left behind: {left}"
    assert not new_shm, f"/dev/shm files left behind: {sorted(new_shm)}"


def run_cli(args: list[str], *, timeout_s: float = 120, env: dict | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run `unbroken ARGS` in its own process group; kill the whole group on timeout."""
    full_env = dict(os.environ, **(env or {}))
    proc = subprocess.Popen([sys.executable, "-m", "unbroken.cli.main", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=full_env, cwd=cwd or REPO,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"unbroken {' '.join(args)} timed out after {timeout_s} s\n"
                             f"stdout:\n{out[-4000:]}\nstderr:\n{err[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
