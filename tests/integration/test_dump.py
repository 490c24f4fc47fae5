"""Rung `dump` (the dying gasp): survivors write one consistent copy from replicas; the job
restarts from it and loses at most the step in flight."""

from __future__ import annotations

import pytest

from tests.integration.helpers import assert_same_weights, events, reference_run, train

STEPS = 12
SHARDED = ["--optimizer", "sharded", "--num-replicas", "2"]
DUMP_ONLY = ["--recover-strategy", "dump,exit"]


@pytest.fixture(scope="module")
def sharded_reference(tmp_path_factory):
    return reference_run(tmp_path_factory, "sharded-reference", steps=STEPS, train_args=SHARDED)


@pytest.mark.timeout(200)
def test_dump_commits_the_step_in_flight_and_the_job_resumes_from_it(tmp_path, sharded_reference):
    ckpt = tmp_path / "ckpt"
    result, out, run_dir = train(tmp_path, "dump", steps=STEPS, train_args=SHARDED, flags=[
        *DUMP_ONLY, "--save", str(ckpt), "--ckpt-every-steps", "5", "--inject", "kill:rank=2:step=8"])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert_same_weights(sharded_reference, out)
    assert [d["rung"] for d in events(run_dir, "decision")] == ["dump", "exit"]
    (dumped,) = events(run_dir, "dump_committed")
    assert dumped["step"] in (7, 8)  # the step in flight, or the one before (consistency rule)
    assert (ckpt / f"step_{dumped['step']:08d}" / "MANIFEST.json").exists()
    (recovered,) = events(run_dir, "recovered")
    assert recovered["restored_step"] == dumped["step"] and recovered["step"] - recovered["restored_step"] <= 1


@pytest.mark.timeout(200)
def test_dump_is_refused_without_replicas_and_the_job_falls_to_exit(tmp_path):
    result, _, run_dir = train(tmp_path, "norep", steps=STEPS, train_args=["--optimizer", "sharded", "--num-replicas", "1"], flags=[
        *DUMP_ONLY, "--save", str(tmp_path / "ckpt"), "--ckpt-every-steps", "5", "--inject", "kill:rank=2:step=8"])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    (decision,) = events(run_dir, "decision")
    assert decision["rung"] == "exit" and "no live replica of optimizer shard 2" in decision["reason"]
    assert not events(run_dir, "dump_committed")


@pytest.mark.timeout(200)
def test_a_second_kill_during_the_dump_commits_nothing(tmp_path, sharded_reference):
    ckpt = tmp_path / "ckpt"
    result, out, run_dir = train(tmp_path, "cascade", steps=STEPS, train_args=SHARDED, flags=[
        *DUMP_ONLY, "--save", str(ckpt), "--ckpt-every-steps", "5", "--persist-every-steps", "5",
        "--inject", "kill:rank=2:step=8,kill:rank=1:step=8:at=checkpoint"])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert_same_weights(sharded_reference, out)
    assert not events(run_dir, "dump_committed")
    assert not (ckpt / "step_00000008" / "MANIFEST.json").exists()  # never a half-written dump
    (recovered,) = events(run_dir, "recovered")
    assert recovered["restored_step"] == 5  # the newest committed checkpoint
