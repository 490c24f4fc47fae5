"""A folder named `unbroken` in the launch directory does not shadow the installed package
(issue 11, item 4): the warm spare that replaces a killed rank imports the real one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import EXAMPLE
from tests.integration.helpers import TRAIN_ARGS, assert_same_weights, events, train

STEPS = 10


def _unbroken_command() -> list[str]:
    """`unbroken` as a user runs it: the console script next to this interpreter (its own folder
    first on sys.path, not the working directory)."""
    script = Path(sys.executable).parent / "unbroken"
    return [str(script)] if script.exists() else [sys.executable, "-P", "-m", "unbroken.cli.main"]


@pytest.mark.timeout(240)
def test_a_kill_is_recovered_when_launched_from_a_folder_holding_an_unbroken_folder(tmp_path):
    clean, reference, _ = train(tmp_path, "reference", steps=STEPS, nproc=2)
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
    launch_dir = tmp_path / "checkout"
    (launch_dir / "unbroken").mkdir(parents=True)  # e.g. a source checkout: a namespace package here
    (launch_dir / "unbroken" / "README").write_text("not the package\n")
    out, run_dir = tmp_path / "killed.safetensors", tmp_path / "run-killed"
    cmd = [*_unbroken_command(), "run", "--nproc-per-node", "2", "--run-dir", str(run_dir),
           "--inject", "kill:rank=1:step=5", str(EXAMPLE), "--steps", str(STEPS), "--out", str(out), *TRAIN_ARGS]
    proc = subprocess.Popen(cmd, cwd=launch_dir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "has no attribute" not in stdout
    assert_same_weights(reference, out)
    assert [d["rung"] for d in events(run_dir, "decision")] == ["recover-in-place"]
    assert len(events(run_dir, "attempt_started")) == 1, "the job was restarted"
