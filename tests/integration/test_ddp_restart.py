"""Stock DistributedDataParallel with the unbroken loop API on a group the script built itself
(not in-flight recoverable): a job restart is bit-exact, from the memory tier and from storage
(4 real gloo ranks, per-rank seeds and dropout, a sampler). A DDP on the default group is
recovered in flight instead: tests/integration/test_ddp_in_flight.py.

Why it needs care: DDP rebuilds its gradient buckets after its first iteration, and gloo's
sum of an element depends on its offset in the bucket; ``job.track`` lays the buckets out
before the first step so every attempt reduces like the fault-free run (worker/wrappers.py).
"""

from __future__ import annotations

import pytest

from tests.integration.helpers import events
from tests.integration.real_scripts import assert_same_state, run_real

STEPS = 12
SCRIPT = ["--wrapper", "ddp-own-group", "--per-rank-seed", "--data", "sampler"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    result, out, _ = run_real(tmp_path_factory.mktemp("ddp-reference"), "reference", steps=STEPS, script_args=SCRIPT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


@pytest.mark.slow  # default run: DDP in flight (test_ddp_in_flight), restart from memory (test_job_restart)
@pytest.mark.timeout(240)
def test_ddp_job_restart_from_memory_is_bit_exact(tmp_path, reference):
    result, out, run_dir = run_real(tmp_path, "kill", steps=STEPS, script_args=SCRIPT, flags=[
        "--save", str(tmp_path / "ckpt"), "--ckpt-every-steps", "5", "--inject", "kill:rank=2:step=7"])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert_same_state(reference, out)
    (decision,) = events(run_dir, "decision")
    # Not in flight (this DDP's group cannot move to a new generation), and the reason says so.
    assert decision["rung"] == "exit" and "DistributedDataParallel" in decision["reason"], decision
    restored = events(run_dir, "restored")
    assert {(e["step"], e["tier"]) for e in restored} == {(5, "memory")} and len(restored) == 4


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ddp_restart_from_storage_is_bit_exact(tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    first, _, _ = run_real(tmp_path, "first", steps=6, script_args=SCRIPT, flags=[
        "--save", str(ckpt), "--ckpt-every-steps", "1", "--persist-every-steps", "5"])
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    result, out, run_dir = run_real(tmp_path, "resumed", steps=STEPS, script_args=SCRIPT, flags=["--load", str(ckpt)])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert_same_state(reference, out)
    restored = events(run_dir, "restored")
    assert len(restored) == 4 and {e["tier"] for e in restored} == {"storage"}, restored
    assert 0 < restored[0]["step"] < STEPS
