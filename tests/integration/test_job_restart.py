"""Job-level recovery (the `exit` rung) with 4 real gloo ranks: exact weights after faults.

These runs allow only `--recover-strategy exit`, so every fault restarts the whole job.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import EXAMPLE, free_port
from tests.integration.helpers import TRAIN_ARGS, assert_same_weights, events, reference_run, train

STEPS = 12
EXIT_ONLY = ["--recover-strategy", "exit"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Final weights of the fault-free 4-rank run (computed once per module)."""
    return reference_run(tmp_path_factory, steps=STEPS)


@pytest.mark.timeout(200)
def test_sigkill_of_one_worker_resumes_bit_exact(tmp_path, reference):
    result, out, run_dir = train(tmp_path, "kill", steps=STEPS, flags=[*EXIT_ONLY,
        "--save", str(tmp_path / "ckpt"), "--ckpt-every-steps", "5", "--inject", "kill:rank=2:step=7"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert_same_weights(reference, out)
    (decision,) = events(run_dir, "decision")
    assert (decision["rung"], decision["rank"], decision["kind"]) == ("exit", 2, "crash")
    restored = events(run_dir, "restored")
    assert {(e["step"], e["tier"]) for e in restored} == {(5, "memory")} and len(restored) == 4
    # The controller decided the step from every rank's offer: each loads it from its own memory.
    (decided,) = [e for e in events(run_dir, "restore_decided") if e["attempt"] == 1]
    assert (decided["step"], decided["tier"], decided["tiers"], decided["round"]) == (5, "memory", ["memory"] * 4, 0)
    (recovered,) = events(run_dir, "recovered")
    assert recovered["step"] == 7 and recovered["restored_step"] == 5


@pytest.mark.slow  # hangs in the default run: test_in_flight, test_hang_blame
@pytest.mark.timeout(200)
def test_hung_worker_is_detected_killed_and_the_job_restarted(tmp_path, reference):
    result, out, run_dir = train(tmp_path, "hang", steps=STEPS, flags=[*EXIT_ONLY,
        "--save", str(tmp_path / "ckpt"), "--ckpt-every-steps", "5", "--inject", "hang:rank=1:step=8"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert_same_weights(reference, out)
    (injected,) = events(run_dir, "fault_injected")
    (detected,) = events(run_dir, "hang_detected")
    assert detected["rank"] == 1
    restart = [e for e in events(run_dir, "attempt_started") if e["attempt"] == 1][0]
    bound_s = max(10.0, 5 * (detected["median_step_s"] or 0))
    assert restart["t"] - injected["t"] <= bound_s, (restart["t"] - injected["t"], bound_s)


@pytest.mark.slow  # a plain torchrun job restart stays in test_plain_scripts
@pytest.mark.timeout(200)
def test_sigkill_under_plain_torchrun_resumes_bit_exact(tmp_path, reference):
    """The same script under plain torchrun: job-level restart with our checkpoints."""
    out = tmp_path / "torchrun.safetensors"
    proc = _torchrun(tmp_path, out, UNBROKEN_SAVE_DIR=str(tmp_path / "ckpt"), UNBROKEN_CKPT_EVERY_STEPS="5",
                     UNBROKEN_INJECT="kill:rank=2:step=7", UNBROKEN_RUN_DIR=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_same_weights(reference, out)


def _torchrun(tmp_path, out, **env_vars) -> subprocess.CompletedProcess:
    """The example under plain torchrun, 4 ranks, one restart allowed."""
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1", **env_vars)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--max-restarts", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(EXAMPLE),
           "--steps", str(STEPS), "--out", str(out), *TRAIN_ARGS]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_corrupt_newest_checkpoint_is_skipped_with_a_warning(tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    # Checkpoints written synchronously by the workers (plain torchrun: no memory tier), so
    # steps 5 and 10 are both on disk whatever the machine's load.
    first = _torchrun(tmp_path, tmp_path / "first.safetensors", UNBROKEN_SAVE_DIR=str(ckpt),
                      UNBROKEN_PERSIST_EVERY_STEPS="5")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert (ckpt / "step_00000010" / "MANIFEST.json").exists()
    victim = ckpt / "step_00000010" / "rank_00001.safetensors"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    result, out, run_dir = train(tmp_path, "resumed", steps=STEPS, flags=["--load", str(ckpt)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert str(victim) in result.stdout + result.stderr, "the warning must name the corrupt file"
    assert {e["step"] for e in events(run_dir, "restored")} == {5}
    # Every rank offered step 10 (its files look whole); rank 1 failed to load it, so the
    # controller decided again, older than 10.
    assert [(e["round"], e["step"]) for e in events(run_dir, "restore_decided")] == [(0, 10), (1, 5)]
    assert_same_weights(reference, out)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_two_agents_on_loopback_recover_a_crash_on_the_second_node(tmp_path, reference):
    port = free_port()
    env = dict(os.environ, UNBROKEN_JOB_SECRET="test-secret-0123456789-" + "x" * 20)  # strong enough (>= 10 distinct)
    out = tmp_path / "multinode.safetensors"
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "unbroken.cli.main", "run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "2", "--master-port", str(port), "--run-dir", str(tmp_path / f"node{node}"),
               *EXIT_ONLY, "--save", str(tmp_path / "ckpt"), "--ckpt-every-steps", "5",
               "--inject", "kill:rank=3:step=7",
               str(EXAMPLE), "--steps", str(STEPS), "--out", str(out), *TRAIN_ARGS]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    assert_same_weights(reference, out)
    (decision,) = events(tmp_path / "node0", "decision")
    assert decision["rank"] == 3


@pytest.mark.timeout(120)
def test_restart_budget_spent_reports_the_root_cause(tmp_path):
    result, _, run_dir = train(tmp_path, "budget", steps=6, nproc=2, flags=[*EXIT_ONLY,
        "--max-restarts", "0", "--inject", "raise:rank=1:step=3"])
    assert result.returncode == 1
    assert "root cause: rank 1" in result.stderr
    assert "InjectedFault" in result.stderr  # the last lines of the failed rank's output
    assert events(run_dir, "job_finished")[0]["exit_code"] == 1
