"""Bad input at the edges: clear messages, exit code 2 for usage errors, no crash of a live controller."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import EXAMPLE, REPO, free_port, run_cli
from unbroken.errors import AuthError
from unbroken.protocol.wire import connect


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags, expected", [
    (["--nproc-per-node", "0"], "--nproc-per-node must be >= 1, got 0"),
    (["--nproc-per-node", "two"], "'two' is not an integer"),
    (["--inject", "kil:rank=1:step=3"], "unknown fault kind 'kil'"),
    (["--inject", "kill:rank=9:step=3"], "rank 9"),
    (["--recover-strategy", "pray"], "unknown strategy 'pray'"),
    (["--ckpt-every-steps", "5"], "--ckpt-every-steps/--persist-every-steps need --save DIR"),
    (["--save", "ckpt", "--shm-dir", "/nonexistent/shm"], "--shm-dir '/nonexistent/shm' is not a directory"),
    (["--nnodes", "1:4"], "elastic node ranges are not supported"),
    (["--controller-store", "etcd:/127.0.0.1"], "expected etcd://HOST:PORT[,HOST:PORT...]"),
])
def test_bad_flags_exit_2_with_a_clear_message(tmp_path, flags, expected):
    result = run_cli(["run", "--run-dir", str(tmp_path / "run"), *flags, str(EXAMPLE)], timeout_s=30)
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr


@pytest.mark.timeout(60)
def test_missing_script_exits_2(tmp_path):
    result = run_cli(["run", "--run-dir", str(tmp_path / "run"), str(tmp_path / "nope.py")], timeout_s=30)
    assert result.returncode == 2
    assert "training script not found" in result.stderr and "nope.py" in result.stderr


@pytest.mark.timeout(150)
def test_wrong_secret_and_garbage_on_the_control_port_leave_the_job_running(tmp_path):
    port = free_port()
    secret = "the-right-secret-" + "y" * 16
    env = dict(os.environ, UNBROKEN_JOB_SECRET=secret)
    cmd = [sys.executable, "-m", "unbroken.cli.main", "run", "--nproc-per-node", "2", "--master-port", str(port),
           "--run-dir", str(tmp_path / "run"), str(EXAMPLE), "--steps", "30", "--optimizer", "plain",
           "--step-sleep-s", "0.1"]
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:  # wait until the controller listens
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "controller never listened"
                time.sleep(0.1)
        with pytest.raises(AuthError, match="wrong job secret"):
            connect("127.0.0.1", port, b"not-the-secret-" + b"z" * 16, "agent", {"node_rank": 0}, timeout_s=5)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"\xff" * 64)  # garbage instead of a handshake
        output, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    assert job.returncode == 0, output[-3000:]
    assert "job finished" in output


@pytest.mark.timeout(60)
def test_an_unchanged_torchrun_script_runs_under_the_launcher(tmp_path):
    script = REPO / "tests" / "integration" / "scripts" / "plain_torchrun_script.py"
    result = run_cli(["run", "--nproc-per-node", "3", "--run-dir", str(tmp_path / "run"), str(script)],
                     timeout_s=50)
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in range(3):
        assert f"[rank {rank}] rank {rank} of 3: sum 6" in result.stdout
