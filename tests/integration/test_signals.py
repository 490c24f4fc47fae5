"""SIGTERM to `unbroken run` (what Kubernetes and Slurm send) stops the job as Ctrl-C does
(issue 11, item 8): forwarded to every worker with a grace period, shared memory released."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "tests" / "integration" / "scripts" / "sigterm_script.py"


@pytest.mark.timeout(120)
def test_sigterm_is_forwarded_to_workers_and_releases_shared_memory(tmp_path):
    run_dir, marks = tmp_path / "run", tmp_path / "marks"
    marks.mkdir()
    cmd = [sys.executable, "-m", "unbroken.cli.main", "run", "--nproc-per-node", "2", "--run-dir", str(run_dir),
           "--save", str(tmp_path / "ckpt"), "--persist-every-steps", "0", str(SCRIPT), str(marks)]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                           cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while not all((marks / f"running-r{r}").exists() for r in (0, 1)):
            assert time.monotonic() < deadline and job.poll() is None, "the workers never reached step 3"
            time.sleep(0.1)
        job_id = json.loads((run_dir / "config.node0.json").read_text())["job_id"]
        assert [n for n in os.listdir("/dev/shm") if n.startswith(f"unbroken-{job_id}-")], "no snapshot files"
        job.send_signal(signal.SIGTERM)
        output, _ = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
    assert job.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert "terminated (SIGTERM)" in output
    assert sorted(p.name for p in marks.glob("sigterm-r*")) == ["sigterm-r0", "sigterm-r1"], output[-3000:]
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"unbroken-{job_id}")]
