"""The two checkpoint tiers under the launcher: memory snapshots, background persistence."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import EXAMPLE, mounted_tmpfs, run_cli
from tests.integration.helpers import TRAIN_ARGS, events, train


@pytest.mark.timeout(200)
def test_a_failing_storage_write_keeps_the_previous_checkpoint_and_training_goes_on(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "step_00000010").write_text("in the way")  # a file where step 10's directory must go
    result, _, run_dir = train(tmp_path, "full", steps=12, train_args=["--step-sleep-s", "0.1"], flags=[
        "--save", str(ckpt), "--ckpt-every-steps", "1", "--persist-every-steps", "5"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert [e["step"] for e in events(run_dir, "persist_failed")] == [10]
    assert (result.stdout + result.stderr).count("persisting step 10 failed") == 1  # said once
    assert not (ckpt / "step_00000010").is_dir()
    # Step 5 is persisted unless the persister was still busy when step 10 committed (a
    # loaded machine): then it persists the newest and skips the stale one, by design.
    persisted = [e["step"] for e in events(run_dir, "checkpoint_persisted")]
    assert persisted in ([5], [])
    verify = run_cli(["ckpt", "verify", str(ckpt)], timeout_s=60)
    assert verify.returncode == 0, verify.stdout
    if persisted:
        assert (ckpt / "latest").read_text().strip() == "step_00000005"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ctrl_c_stops_the_workers_and_releases_shared_memory(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "unbroken.cli.main", "run", "--nproc-per-node", "2", "--run-dir", str(run_dir),
           "--save", str(tmp_path / "ckpt"), str(EXAMPLE), "--steps", "1000", "--step-sleep-s", "0.05", *TRAIN_ARGS]
    # SIGINT as a terminal delivers it: a test run started in the background (`nohup pytest &`) passes its
    # children SIGINT ignored, and an interpreter started so keeps ignoring it.
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while not events(run_dir, "checkpoint_persisted"):  # snapshots exist, one step persisted
            assert time.monotonic() < deadline and job.poll() is None, "no checkpoint within 60 s"
            time.sleep(0.2)
        job_id = json.loads((run_dir / "config.node0.json").read_text())["job_id"]
        assert [n for n in os.listdir("/dev/shm") if n.startswith(f"unbroken-{job_id}-")]
        job.send_signal(signal.SIGINT)
        output, _ = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
    assert job.returncode == 130, output[-3000:]
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"unbroken-{job_id}")]


@pytest.fixture
def shm_300m(tmp_path):
    """A 300 MiB tmpfs as the shm dir (needs root and mount); skipped where it cannot be mounted."""
    with mounted_tmpfs(tmp_path / "shm", "300m") as path:
        yield path


@pytest.mark.timeout(120)
def test_a_memory_tier_too_big_for_the_shm_dir_fails_before_step_0_without_a_restart(tmp_path, shm_300m):
    # 2 ranks x 2 slots of a ~40 MB AdamW snapshot, plus 256 MiB of headroom: more than 300 MiB.
    # (The default model's 8 MiB of slots would fit.)
    started = time.monotonic()
    result, _, run_dir = train(tmp_path, "big", steps=5, nproc=2, timeout_s=90, train_args=[
        "--n-embd", "256", "--n-layer", "4", "--n-head", "4"], flags=[
        "--save", str(tmp_path / "ckpt"), "--shm-dir", str(shm_300m)])
    elapsed = time.monotonic() - started
    output = result.stdout + result.stderr
    assert result.returncode == 97, output[-3000:]  # EXIT_FATAL: the cluster manager must not restart it
    assert elapsed < 60, f"took {elapsed:.1f} s"
    assert "ShmCapacityError" in output and f"does not fit in {shm_300m}" in output
    assert "--ckpt-every-steps 0" in output
    exits = events(run_dir, "rank_exited")
    assert 97 in [e["exit_code"] for e in exits] and {e["attempt"] for e in exits} == {0}
    assert all(e["step"] in (None, 0) for e in exits)  # before the first step ran
    assert [e["attempt"] for e in events(run_dir, "attempt_started")] == [0]  # no restart
    assert [e["rung"] for e in events(run_dir, "decision")] == ["give-up"]
    assert "does not fit" in events(run_dir, "fatal_error")[0]["error"]
    (finished,) = events(run_dir, "job_finished")
    assert finished["exit_code"] == 97 and "EXIT_FATAL" in finished["reason"]
    assert not [n for n in os.listdir(shm_300m) if n.startswith("unbroken-")]
