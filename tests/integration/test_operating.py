"""Operating a job: /metrics, `unbroken status` and `unbroken report` against a real 4-rank run.

One job with a SIGKILL injected, watched while it runs: the metrics port counts the fault,
the recovery by rung and each of its phases; `unbroken status` shows the live rank table
(from the run directory and from the metrics port); after the job, `unbroken status` gives
the finished summary and `unbroken report` a goodput table whose rows add up to the wall time.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.conftest import REPO, free_port, run_cli
from tests.integration.helpers import events

SCRIPT = Path(__file__).parent / "scripts" / "gated_script.py"  # runs until the test opens its gate


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def _sample(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample of a Prometheus text exposition (None: absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if labels else "") + r" ([0-9.e+-]+)$"
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else None


def _start_job(tmp_path: Path, port: int, gate: Path) -> tuple[subprocess.Popen, Path]:
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "unbroken.cli.main", "run", "--nproc-per-node", "4", "--run-dir", str(run_dir),
            "--metrics-port", str(port), "--inject", "kill:rank=2:step=10", str(SCRIPT), str(gate), "5000"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            start_new_session=True)
    return proc, run_dir


def _wait_for(pred, proc: subprocess.Popen, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = pred()
        except OSError:
            value = None
        if value:
            return value
        assert proc.poll() is None, f"the job ended before {what}"
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_live_job_metrics_status_then_finished_summary_and_report(tmp_path):
    port, gate = free_port(), tmp_path / "gate"
    proc, run_dir = _start_job(tmp_path, port, gate)
    try:
        # Live: the recovery of the SIGKILL, counted with its phases, while the job still runs.
        text = _wait_for(lambda: (lambda t: t if _sample(t, "unbroken_recovery_seconds_count", phase="redo")
                                  else None)(_scrape(port)), proc, 150, "the recovery in /metrics")
        assert _sample(text, "unbroken_faults_total", kind="crash") == 1.0
        assert _sample(text, "unbroken_recoveries_total", rung="recover-in-place") == 1.0
        for phase in ("detect", "replace", "regroup", "restore", "redo"):
            assert _sample(text, "unbroken_recovery_seconds_count", phase=phase) == 1.0, phase
        assert _sample(text, "unbroken_recovery_seconds_sum", phase="restore") > 0
        assert _sample(text, "unbroken_steps_completed_total") >= 10
        assert _sample(text, "unbroken_generation") == 1.0
        assert _sample(text, "unbroken_world_size") == 4.0
        assert text.count("unbroken_step_seconds_bucket") > 3

        live = run_cli(["status", "--address", f"127.0.0.1:{port}", "--json"], timeout_s=30)
        assert live.returncode == 0, live.stderr
        status = json.loads(live.stdout)
        assert [r["rank"] for r in status["ranks"]] == [0, 1, 2, 3]
        assert status["generation"] == 1 and status["phase"] == "running"
        assert "signal 9 at step 10" in status["ranks"][2]["last_fault"]
        from_dir = run_cli(["status", str(run_dir)], timeout_s=30)
        assert from_dir.returncode == 0, from_dir.stderr
        assert "running" in from_dir.stdout and "signal 9 at step 10" in from_dir.stdout, from_dir.stdout
        stop_at = json.loads((run_dir / "status.json").read_text())["job_step"] + 10
        tmp = gate.with_suffix(".tmp")
        tmp.write_text(str(stop_at))
        tmp.rename(gate)  # every rank stops after the same step
        out, _ = proc.communicate(timeout=150)
        assert proc.returncode == 0, out[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()

    done = run_cli(["status", str(run_dir), "--json"], timeout_s=30)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    last_step = max(e["step"] for e in events(run_dir, "step"))
    assert summary["state"] == "finished" and summary["exit_code"] == 0 and summary["steps"] == last_step > 10
    assert [(r["rank"], r["rung"]) for r in summary["recoveries"]] == [(2, "recover-in-place")]

    report = run_cli(["report", str(run_dir), "--json"], timeout_s=60)
    assert report.returncode == 0, report.stderr
    bd = json.loads(report.stdout)
    finished, first = events(run_dir, "job_finished")[0], events(run_dir)[0]
    wall_s = finished["t"] - first["t"]
    assert abs(sum(r["seconds"] for r in bd["rows"]) - wall_s) <= 0.01 * wall_s
    seconds = {r["category"]: r["seconds"] for r in bd["rows"]}
    assert seconds["productive"] > 0 and seconds["startup"] > 0 and seconds["restore"] > 0
    text = run_cli(["report", str(run_dir)], timeout_s=60).stdout
    assert "productive steps" in text and "recovery: restore state" in text and "total" in text
