"""EXIT_FATAL under the launcher: a worker that says "do not restart me" fails the job at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.integration.helpers import events
from unbroken.errors import EXIT_FATAL

SCRIPT = Path(__file__).parent / "scripts" / "fatal_script.py"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode, says", [
    ("track", "job.track(data=...): a object has no state_dict"),  # the library's ConfigError
    ("exit", "the dataset is missing; giving up"),  # the script's own sys.exit(EXIT_FATAL)
    ("ema", "the first step changed ema (Linear), which job.track() was not given"),  # untracked state
])
def test_a_fatal_exit_fails_the_job_without_a_restart(tmp_path, mode, says):
    run_dir = tmp_path / "run"
    result = run_cli(["run", "--nproc-per-node", "2", "--run-dir", str(run_dir), "--max-restarts", "5",
                      str(SCRIPT), mode], timeout_s=60)
    output = result.stdout + result.stderr
    assert result.returncode == EXIT_FATAL, output[-3000:]  # 97, for the cluster manager: do not restart
    assert says in output
    (first, code), = [(e["rank"], e["exit_code"]) for e in events(run_dir, "rank_exited")][:1]
    assert code == EXIT_FATAL and first == 1
    assert [e["attempt"] for e in events(run_dir, "attempt_started")] == [0]  # no restart
    assert [(e["rung"], e["kind"]) for e in events(run_dir, "decision")] == [("give-up", "fatal")]
    (finished,) = events(run_dir, "job_finished")
    assert finished["reason"].startswith(f"rank {first} exited with EXIT_FATAL ({EXIT_FATAL}: fatal error, not restarted)")
    assert says in finished["reason"]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_the_same_exception_three_times_in_a_row_stops_the_job(tmp_path):
    """A bug in the script is not a fault of the machine: after the same failure three times
    (in flight, then restarts), the job fails instead of looping up to --max-restarts."""
    run_dir = tmp_path / "run"
    result = run_cli(["run", "--nproc-per-node", "2", "--run-dir", str(run_dir), str(SCRIPT), "bug"], timeout_s=140)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    failed = [e for e in events(run_dir, "rank_exited") if e["rank"] == 1 and e["exit_code"] not in (0, None)]
    assert len(failed) == 3
    (finished,) = events(run_dir, "job_finished")
    assert "crash loop" in finished["reason"] and "batch 2 is empty" in finished["reason"]


@pytest.mark.timeout(150)
def test_a_script_error_on_every_rank_stops_the_job_within_a_few_attempts(tmp_path):
    """Issue 32, case 5: every rank raises in step 1; whichever rank fails first, with its rank in
    its message, it is one deterministic error: exit 1 with its last lines, not restarts forever."""
    run_dir = tmp_path / "run"
    result = run_cli(["run", "--nproc-per-node", "2", "--run-dir", str(run_dir), str(SCRIPT), "bug-all"],
                     timeout_s=140)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    (finished,) = events(run_dir, "job_finished")
    assert "crash loop" in finished["reason"] and "batch 1 has the wrong shape" in finished["reason"]
    assert len(events(run_dir, "attempt_started")) <= 5  # 3, and a hang-kill of a rank slow to exit may add one
