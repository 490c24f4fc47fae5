"""A shared-memory directory that fills up during training: storage checkpoints go on, a job
restart degrades to storage only, the job finishes with exit 0 and leaves no slot file."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import EXAMPLE, mounted_tmpfs
from tests.integration.helpers import TRAIN_ARGS, assert_same_weights, events, train

STEPS = 24


def _fill(directory) -> None:
    """Write a file until the filesystem is full."""
    with open(directory / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


@pytest.mark.slow  # default run: tests/checkpoint/test_shm_capacity.py, test_save_failures.py
@pytest.mark.timeout(300)
def test_a_full_shm_dir_mid_run_and_a_restart_degrade_to_storage_and_the_job_finishes(tmp_path):
    with mounted_tmpfs(tmp_path / "shm", "300m") as shm:
        run_dir = tmp_path / "run"
        out = tmp_path / "full.safetensors"
        cmd = [sys.executable, "-m", "unbroken.cli.main", "run", "--nproc-per-node", "2", "--run-dir", str(run_dir),
               "--shm-dir", str(shm), "--save", str(tmp_path / "ck"), "--ckpt-every-steps", "1",
               "--persist-every-steps", "4", "--recover-strategy", "exit", "--inject", "kill:rank=1:step=14",
               str(EXAMPLE), "--steps", str(STEPS), "--out", str(out), "--step-sleep-s", "0.15", *TRAIN_ARGS]
        job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            while not events(run_dir, "checkpoint_persisted"):  # the slots exist and one step is in storage
                assert time.monotonic() < deadline and job.poll() is None, "no checkpoint within 120 s"
                time.sleep(0.1)
            _fill(shm)
            output, _ = job.communicate(timeout=200)
        finally:
            if job.poll() is None:
                os.killpg(job.pid, 9)
                job.communicate()
        assert job.returncode == 0, output[-4000:]
        assert "Traceback" not in output, output[-4000:]
        assert [n for n in os.listdir(shm) if n != "filler"] == []  # no slot or owner file left
    off = events(run_dir, "memory_tier_off")
    assert off and all(e["attempt"] == 1 for e in off), off
    assert output.count("the memory tier is off for this attempt") == len(off)  # said once per rank
    assert len(events(run_dir, "persist_failed")) <= 1
    assert json.loads((tmp_path / "ck" / "latest").read_text().strip().join('""')) >= "step_00000016"
    clean, ref, _ = train(tmp_path, "clean", steps=STEPS, nproc=2)
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
    assert_same_weights(out, ref)
