"""Nothing else on the host breaks a job's recovery (issue 11, items 1 and 4).

- A local process without the job secret that writes guessed and old-style rendezvous keys
  (``gen1//0/1``, ``gen0/...``) into the job's TCPStore during a kill changes nothing: the
  job's keys live under a per-attempt random prefix handed out over the control plane.
- A folder named `unbroken` in the launch directory does not shadow the installed package:
  the warm spare that replaces a killed rank imports the real one.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.conftest import EXAMPLE
from tests.integration.helpers import TRAIN_ARGS, assert_same_weights, events, train
from unbroken.controller import rendezvous

STEPS = 10


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Final weights of a fault-free 2-rank run."""
    clean, out, _ = train(tmp_path_factory.mktemp("reference"), "reference", steps=STEPS, nproc=2)
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
    return out


def _unbroken_command() -> list[str]:
    """`unbroken` as a user runs it: the console script next to this interpreter (its own folder
    first on sys.path, not the working directory)."""
    script = Path(sys.executable).parent / "unbroken"
    return [str(script)] if script.exists() else [sys.executable, "-P", "-m", "unbroken.cli.main"]


@pytest.mark.timeout(240)
def test_a_kill_is_recovered_when_launched_from_a_folder_holding_an_unbroken_folder(tmp_path, reference):
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


def _guessed_keys() -> list[str]:
    """What a process without the secret can aim at: the keys of a store without a prefix
    (gloo's under ``gen<g>/``), and random guesses of a prefix."""
    keys = []
    for gen in range(6):
        keys += [f"gen{gen}/", f"gen{gen}//0/0", f"gen{gen}//0/1", f"gen{gen}//1/0", f"gen{gen}//1/1",
                 f"gen{gen}/0", f"gen{gen}/1", f"gen{gen}/rank_0", f"gen{gen}/rank_1"]
    keys += [f"{rendezvous.new_prefix()}/gen1//0/1" for _ in range(8)]
    return keys


def _write_garbage(run_dir: Path, stop: threading.Event, writes: list[int]) -> None:
    """A foreign client: connect to each attempt's store and keep overwriting guessed keys."""
    ports_done: set[int] = set()
    while not stop.is_set():
        ports = {e["store_port"] for e in events(run_dir, "attempt_started")} if (run_dir / "events.jsonl").exists() \
            else set()
        for port in ports:
            try:
                client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2))
                for key in _guessed_keys():
                    client.set(key, secrets.token_bytes(64))
                writes[0] += 1
                ports_done.add(port)
            except (RuntimeError, OSError):
                pass  # that attempt's store is gone
        time.sleep(0.02)


@pytest.mark.timeout(240)
def test_a_foreign_client_writing_guessed_rendezvous_keys_during_a_kill_changes_nothing(tmp_path, reference):
    run_dir = tmp_path / "run-attacked"
    stop, writes = threading.Event(), [0]
    attacker = threading.Thread(target=_write_garbage, args=(run_dir, stop, writes), daemon=True)
    attacker.start()
    try:
        result, out, _ = train(tmp_path, "attacked", steps=STEPS, nproc=2, timeout_s=180,
                               flags=["--inject", "kill:rank=1:step=5"], train_args=["--step-sleep-s", "0.05"])
    finally:
        stop.set()
        attacker.join(timeout=10)
    assert writes[0] > 0, "the foreign client never reached the store"
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert_same_weights(reference, out)
    assert [d["rung"] for d in events(run_dir, "decision")] == ["recover-in-place"]
    assert len(events(run_dir, "attempt_started")) == 1, "the job was restarted"

