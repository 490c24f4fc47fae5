"""A rank that dies after it finished its step loop: a warning, not a recovery (controller/loop_end.py)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.integration.helpers import events

SCRIPT = Path(__file__).parent / "scripts" / "after_loop_script.py"


@pytest.mark.timeout(90)
def test_a_rank_killed_after_its_loop_ends_the_job_at_once_with_success(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli(["run", "--nproc-per-node", "2", "--run-dir", str(run_dir), str(SCRIPT)], timeout_s=80)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]  # every rank finished its loop: success
    (warning,) = events(run_dir, "exited_after_loop")
    assert (warning["rank"], warning["signal"]) == (1, signal.SIGKILL)
    assert [e["attempt"] for e in events(run_dir, "attempt_started")] == [0]  # no job restart
    assert not events(run_dir, "decision") and not events(run_dir, "restart_worker")  # no recovery
    (died,) = [e for e in events(run_dir, "worker_exited") if e["rank"] == 1]
    (finished,) = events(run_dir, "job_finished")
    # promptly: rank 0 exits as soon as it is done (the old path waited for the 60 s recovery timeout)
    assert finished["t"] - died["t"] < 30
    assert "ranks [1] exited abnormally afterwards" in finished["reason"]
