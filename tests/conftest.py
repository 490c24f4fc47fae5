"""Shared test helpers: free ports, running the CLI in a subprocess, and leak checks.

Every multi-process test must leave no process and no /dev/shm file of ours behind, even
when it fails: the autouse fixture below kills what a test left and fails the test.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train_gpt.py"


def run_machine(state, *events):
    """Feed ``events`` to the controller's pure state machine; (final state, every action)."""
    from unbroken.controller import machine as sm

    actions = []
    for event in events:
        state, more = sm.transition(state, event)
        actions += more
    return state, actions


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ours(proc: psutil.Process, marker: str) -> bool:
    try:
        env = proc.environ()
        cmd = " ".join(proc.cmdline())
    except (psutil.Error, OSError):
        return False
    return marker in env.get("UNBROKEN_RUN_DIR", "") or marker in cmd


def shm_files(job_ids: set[str] | None = None) -> set[str]:
    """Our files in /dev/shm; only those of ``job_ids`` when given."""
    try:
        names = {n for n in os.listdir("/dev/shm") if n.startswith("unbroken")}
    except FileNotFoundError:
        return set()
    if job_ids is None:
        return names
    return {n for n in names if any(n.startswith(f"unbroken-{j}-") or n == f"unbroken-{j}.owner" for j in job_ids)}


def job_ids(root: Path) -> set[str]:
    """Job ids of every launcher run under ``root`` (from the resolved configs they wrote)."""
    ids = set()
    for cfg in root.glob("**/config.node*.json"):
        try:
            ids.add(json.loads(cfg.read_text())["job_id"])
        except (OSError, ValueError, KeyError):
            pass
    return ids


@pytest.fixture(autouse=True)
def no_leftovers(tmp_path):
    """Fail a test that leaves processes or shared memory behind; clean up either way."""
    yield
    me = psutil.Process()
    left = [p for p in me.children(recursive=True)]
    left += [p for p in psutil.process_iter() if p.pid != me.pid and p not in left and ours(p, str(tmp_path))]
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=5)
    leftover_shm = shm_files(job_ids(tmp_path))
    for name in leftover_shm:
        try:
            os.unlink(f"/dev/shm/{name}")
        except FileNotFoundError:
            pass
    assert not [p.pid for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], \
        f"processes left behind: {left}"
    assert not leftover_shm, f"/dev/shm files left behind: {sorted(leftover_shm)}"


def pytest_sessionfinish(session, exitstatus):
    """After the whole suite: nothing of ours may be left in /dev/shm."""
    left = shm_files()
    if left and exitstatus == 0 and os.environ.get("CI"):
        session.exitstatus = 1
        print(f"\n/dev/shm files left behind by the test suite: {sorted(left)}")


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


@contextmanager
def mounted_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (e.g. "8m") mounted at ``path`` (created); skips the test where it
    cannot be mounted (needs root). Unmounted (lazily) at the end, even on failure."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)
