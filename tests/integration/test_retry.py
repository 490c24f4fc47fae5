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
@pytest.mark.parametrize("fault", ["corrupt:rank=2:step=6:what=optimizer",  # the default run's; the others slow
                                   pytest.param("corrupt:rank=1:step=6:what=params", marks=pytest.mark.slow),
                                   pytest.param("corrupt:rank=3:step=6:what=grads:at=sync", marks=pytest.mark.slow)])
def test_memory_fault_repaired_by_retry_bit_exact(tmp_path, sharded_reference, fault):
    result, out, run_dir = train(tmp_path, "retry", steps=STEPS, train_args=SHARDED, flags=["--inject", fault])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert_same_weights(sharded_reference, out)
    (damage,) = events(run_dir, "memory_fault")
    assert "nothing to damage" not in damage["what"]  # the fault really overwrote a tensor
    (decision,) = events(run_dir, "decision")
    assert decision["rung"] == "retry"
    assert len(events(run_dir, "rank_started")) == 4, "a process was restarted"
    assert not events(run_dir, "restored"), "storage was read"
    (done,) = events(run_dir, "recovered_in_flight")
    assert done["replaced"] == [int(fault.split("rank=")[1][0])] and done["resume_step"] == 6


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_nan_loss_redone_by_retry_bit_exact(tmp_path, sharded_reference):
    """An injected NaN loss (the model's outputs turn NaN for one forward) is caught before the
    gradient reduction spreads it; every rank redoes the step."""
    result, out, run_dir = train(tmp_path, "nan", steps=STEPS, train_args=SHARDED,
                                 flags=["--inject", "nan:rank=2:step=7"])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert_same_weights(sharded_reference, out)
    (found,) = events(run_dir, "non_finite")
    assert found["rank"] == 2 and "non-finite gradients in step 7" in found["what"]
    (decision,) = events(run_dir, "decision")
    assert decision["rung"] == "retry" and decision["kind"] == "non-finite"
    assert len(events(run_dir, "rank_started")) == 4, "a process was restarted"
    assert not events(run_dir, "restored"), "storage was read"
    (done,) = events(run_dir, "recovered_in_flight")
    assert done["resume_step"] == 7


@pytest.fixture(scope="module")
def plain_reference(tmp_path_factory):
    return reference_run(tmp_path_factory, "plain-reference", steps=STEPS)  # TRAIN_ARGS: plain


@pytest.mark.timeout(200)
def test_a_flipped_bit_is_found_by_the_cross_replica_check_and_repaired(tmp_path, plain_reference):
    """Silent data corruption: one bit of one parameter flips on rank 1 (no error raised); the
    cross-replica check at the end of the step names rank 1 and it takes the majority's copy."""
    result, out, run_dir = train(tmp_path, "sdc", steps=STEPS, train_args=["--optimizer", "plain"],
                                 flags=["--sdc-check-every-steps", "1", "--inject", "flip:rank=1:step=5:at=update"])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert_same_weights(plain_reference, out)  # the flip would otherwise survive to the end on rank 1
    (found,) = events(run_dir, "sdc_detected")
    assert found["rank"] == 1 and "differ from the copies of 3 of 4 ranks after step 5" in found["what"]
    (decision,) = events(run_dir, "decision")
    assert decision["rung"] == "retry" and decision["kind"] == "sdc"
    assert len(events(run_dir, "rank_started")) == 4, "a process was restarted"
    (done,) = events(run_dir, "recovered_in_flight")
    assert done["replaced"] == [1] and done["resume_step"] == 6


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_without_the_check_a_flipped_bit_goes_unnoticed(tmp_path, plain_reference):
    """The control for the test above: the same flip without the check ends with other weights
    (rank 0 writes the weights, so the flip goes on rank 0 here)."""
    result, out, run_dir = train(tmp_path, "nocheck", steps=STEPS, train_args=["--optimizer", "plain"],
                                 flags=["--inject", "flip:rank=0:step=5:at=update"])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    with pytest.raises(AssertionError):
        assert_same_weights(plain_reference, out)
    assert not events(run_dir, "sdc_detected") and not events(run_dir, "decision")
