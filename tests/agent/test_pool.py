"""The pool (agent/pool.py): `unbroken pool` imports torch once per machine and user; each agent that
connects gets its own zygote forked from it, whose ranks are the processes the agent would start
(exactly the order's environment, the agent's working directory, the script's own logging, exit
codes), and which ends with its agent. Only this user may use it; an agent of another build does
not. A real pool process, real forks, a real 4-rank job launched with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import run_cli
from unbroken.agent import forks, pool
from unbroken.agent.forks import Zygote
from unbroken.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
CHILD = """
import logging, os, sys
logging.basicConfig(level=logging.INFO, format="LOG %(message)s")  # a no-op if the pool's set-up leaked
logging.info("own logging")
print("rank", os.environ["RANK"], "cwd", os.getcwd(), "stray", os.environ.get("STRAY"), "argv", sys.argv[1:],
      "session", os.getsid(0) == os.getpid(), "torch", "torch" in sys.modules, flush=True)
sys.exit(int(sys.argv[1]))
"""


def start_pool(sock: Path) -> subprocess.Popen:
    popen = subprocess.Popen([sys.executable, "-m", "unbroken.cli.main", "pool", "--socket", str(sock)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                             env=dict(os.environ, STRAY="the pool's"))
    assert popen.stdout is not None
    line = popen.stdout.readline()
    assert "pool ready" in line, line + popen.stdout.read()
    return popen


def stop_pool(popen: subprocess.Popen, sock: Path) -> None:
    popen.send_signal(signal.SIGTERM)
    assert popen.wait(timeout=30) == 0
    assert not sock.exists()  # it removed its socket


@pytest.mark.timeout(180)
def test_each_agent_gets_its_own_zygote_from_the_pool(tmp_path, monkeypatch):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    sock = tmp_path / "pool" / "pool.sock"
    popen = start_pool(sock)
    try:
        assert oct(sock.parent.stat().st_mode & 0o777) == "0o700" and oct(sock.stat().st_mode & 0o777) == "0o600"
        workdir = tmp_path / "job"
        workdir.mkdir()
        monkeypatch.chdir(workdir)
        seen_zygotes = set()
        for job, code in (("1", 3), ("2", 0)):  # two agents, one after the other: neither sees the other
            started = time.monotonic()
            zygote = Zygote.connect(sock)
            assert zygote is not None and zygote.wait_ready(timeout_s=0)  # ready at once: nothing to import
            assert time.monotonic() - started < 5
            assert psutil.Process(zygote.pid).ppid() == popen.pid and zygote.pid not in seen_zygotes
            seen_zygotes.add(zygote.pid)
            rank = zygote.fork({"RANK": job, "PATH": os.environ["PATH"]}, [str(script), str(code)])
            assert rank is not None, zygote.unusable
            lines = rank.stdout.read().decode().splitlines()
            assert lines == ["LOG own logging",
                             f"rank {job} cwd {workdir} stray None argv ['{code}'] session True torch True"]
            assert rank.wait(timeout=60) == code
            rank.stdout.close()
            zygote.close()
            deadline = time.monotonic() + 10  # the agent's zygote ends with its connection; the pool reaps it
            while psutil.pid_exists(zygote.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not psutil.pid_exists(zygote.pid)
        assert psutil.Process(popen.pid).children() == []
    finally:
        stop_pool(popen, sock)


@pytest.mark.timeout(120)
def test_the_pool_is_for_its_user_and_its_build_only(tmp_path, monkeypatch):
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    open_dir.chmod(0o755)
    with pytest.raises(ConfigError, match="open to other users"):
        pool.serve(open_dir / "pool.sock")
    assert Zygote.connect(open_dir / "pool.sock") is None  # an agent refuses such a place too

    not_a_socket = tmp_path / "private" / "notes.txt"
    not_a_socket.parent.mkdir(mode=0o700)
    not_a_socket.write_text("keep me")
    with pytest.raises(ConfigError, match="is not a socket"):
        pool.serve(not_a_socket)
    assert not_a_socket.read_text() == "keep me"  # nothing deleted

    sock = tmp_path / "pool" / "pool.sock"
    popen = start_pool(sock)
    try:
        with pytest.raises(ConfigError, match="already listens"):
            pool.serve(sock)  # a second pool on the same socket
        # Another user cannot connect: the socket is 0600 in a 0700 directory.
        probe = subprocess.run([sys.executable, "-c", (
            "import os, socket, sys\n"
            "os.setgid(65534); os.setuid(65534)\n"
            "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
            "try:\n    s.connect(sys.argv[1])\nexcept PermissionError:\n    sys.exit(7)\n"), str(sock)],
            capture_output=True, text=True, timeout=60)
        if os.getuid() == 0:
            assert probe.returncode == 7, probe.stderr
        # An agent of another build (interpreter, environment, unbroken, torch, import path) does not use it.
        real = forks.zygote_build()
        monkeypatch.setattr(forks, "zygote_build", lambda: dict(real, prefix="/elsewhere/venv"))
        assert Zygote.connect(sock) is None
        monkeypatch.setattr(forks, "zygote_build", lambda: real)
        zygote = Zygote.connect(sock)
        assert zygote is not None
        zygote.close()
    finally:
        stop_pool(popen, sock)


@pytest.mark.timeout(240)
def test_a_job_launched_with_a_pool(tmp_path):
    """`unbroken run --pool-socket`: the ranks fork from the pool's zygote for this agent; the job ends
    as any job does, and the pool is left as it was (no child of it remains)."""
    sock_dir = tmp_path / "pool"
    sock_dir.mkdir(mode=0o700)
    with pool.running(sock_dir / "pool.sock") as sock:  # as the demo runs its two jobs
        assert sock == sock_dir / "pool.sock"
        pool_pid = next(p.pid for p in psutil.Process().children() if "pool" in p.cmdline())
        res = run_cli(["run", "--nproc-per-node", "4", "--run-dir", str(tmp_path / "run"), "--pool-socket", str(sock),
                       str(REPO / "examples" / "train_gpt.py"), "--steps", "3"], timeout_s=200)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        assert "not using the pool" not in res.stderr and "starting a zygote" not in res.stderr
        assert "job finished" in res.stdout
        started = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()
                   if '"rank_started"' in line]
        assert sorted(e["rank"] for e in started) == [0, 1, 2, 3] and {e["how"] for e in started} == {"pool"}
        deadline = time.monotonic() + 10
        while psutil.Process(pool_pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert psutil.Process(pool_pid).children() == []
    assert not psutil.pid_exists(pool_pid) and not (sock_dir / "pool.sock").exists()
