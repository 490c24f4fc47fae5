"""An unchanged torchrun DDP script (no unbroken API) under `unbroken run`: crash detection and
job restarts only, never a hang kill for step progress it cannot report. Real gloo ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.integration.helpers import events

SCRIPT = Path(__file__).parent / "scripts" / "plain_ddp_script.py"
FIRST_STEP_TIMEOUT_S = 2.0


def _progress(path: Path) -> list[tuple[int, int]]:
    """(restart count, step) lines a rank wrote."""
    if not path.exists():
        return []
    return [tuple(int(v) for v in line.split()) for line in path.read_text().splitlines() if line.strip()]


def _pid_of(run_dir: Path, rank: int, attempt: int) -> int | None:
    for e in events(run_dir, "rank_started"):
        if e["rank"] == rank and e["attempt"] == attempt:
            return e["pid"]
    return None


@pytest.mark.timeout(150)
def test_plain_ddp_script_is_never_killed_as_hung_and_a_crash_restarts_the_job(tmp_path):
    run_dir, progress = tmp_path / "run", tmp_path / "progress"
    # 3.25x --first-step-timeout-s of training per attempt, with no step progress reported.
    seconds = 3.25 * FIRST_STEP_TIMEOUT_S
    args = [sys.executable, "-m", "unbroken.cli.main", "run", "--nproc-per-node", "2", "--run-dir", str(run_dir),
            "--first-step-timeout-s", str(FIRST_STEP_TIMEOUT_S), "--max-restarts", "2", "--crash-loop-limit", "0",
            str(SCRIPT), "--seconds", str(seconds), "--progress", str(progress)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            start_new_session=True)
    try:
        # Attempt 0: once rank 1 trained past the first-step timeout, kill it (a crash).
        deadline = time.monotonic() + 90
        while not [s for a, s in _progress(Path(f"{progress}.rank1")) if a == 0 and s >= 10 * FIRST_STEP_TIMEOUT_S * 1.2]:
            assert proc.poll() is None and time.monotonic() < deadline, "attempt 0 ended or never trained"
            time.sleep(0.1)
        os.kill(_pid_of(run_dir, 1, 0), signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert not events(run_dir, "hang_detected"), "a plain script was killed as hung"
    (decision,) = events(run_dir, "decision")
    assert (decision["rung"], decision["rank"], decision["kind"]) == ("exit", 1, "crash")
    assert decision["committed_step"] is None and "before its first step" not in decision["reason"]
    assert len(events(run_dir, "attempt_started")) == 2
    steps = round(seconds / 0.1)
    for rank in range(2):  # attempt 1 trained to the end on every rank, unkilled
        assert [s for a, s in _progress(Path(f"{progress}.rank{rank}")) if a == 1] == list(range(steps))
