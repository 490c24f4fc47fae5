"""Rung `retry`: state damaged in memory is repaired from replicas; no process exits."""

from __future__ import annotations

import pytest

from tests.integration.helpers import assert_same_weights, events, reference_run, train

STEPS = 12
SHARDED = ["--optimizer", "sharded", "--num-replicas", "2"]


@pytest.fixture(scope="module")
def sharded_reference(tmp_path_factory):
    return reference_run(tmp_path_factory, "sharded-reference", steps=STEPS, train_args=SHARDED)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("fault", ["corrupt:rank=1:step=6:what=params",
                                   "corrupt:rank=2:step=6:what=optimizer",
                                   "corrupt:rank=3:step=6:what=grads:at=sync"])
def test_memory_fault_repaired_by_retry_bit_exact(tmp_path, sharded_reference, fault):
    result, out, run_dir = train(tmp_path, "retry", steps=STEPS, train_args=SHARDED, flags=["--inject", fault])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert_same_weights(sharded_reference, out)
    (damage,) = events(run_dir, "memory_fault")
    assert "nothing to damage" not in damage["what"]  # the fault really overwrote a tensor
    (decision,) = events(run_dir, "decision")
    assert decision["rung"] == "retry"
    assert len(events(run_dir, "worker_started")) == 4, "a process was restarted"
    assert not events(run_dir, "restored"), "storage was read"
    (done,) = events(run_dir, "recovered_in_flight")
    assert done["replaced"] == [int(fault.split("rank=")[1][0])] and done["resume_step"] == 6
