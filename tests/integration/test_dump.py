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


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_dump_is_refused_without_replicas_and_the_job_falls_to_exit(tmp_path):
    result, _, run_dir = train(tmp_path, "norep", steps=STEPS, train_args=["--optimizer", "sharded", "--num-replicas", "1"], flags=[
        *DUMP_ONLY, "--save", str(tmp_path / "ckpt"), "--ckpt-every-steps", "5", "--inject", "kill:rank=2:step=8"])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    (decision,) = events(run_dir, "decision")
    assert decision["rung"] == "exit" and "no live replica of optimizer shard 2" in decision["reason"]
    assert not events(run_dir, "dump_committed")


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_dump_that_hangs_is_cut_at_the_recovery_deadline(tmp_path, sharded_reference):
    """The dump is bounded in time: a survivor hanging while it writes does not stall the job;
    at --recovery-timeout-s the job restarts from the newest committed checkpoint."""
    ckpt = tmp_path / "ckpt"
    result, out, run_dir = train(tmp_path, "slowdump", steps=STEPS, train_args=SHARDED, flags=[
        *DUMP_ONLY, "--save", str(ckpt), "--ckpt-every-steps", "5", "--persist-every-steps", "5",
        "--recovery-timeout-s", "4", "--inject", "kill:rank=2:step=8,hang:rank=1:step=8:at=checkpoint"])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert_same_weights(sharded_reference, out)
    assert not events(run_dir, "dump_committed")
    decisions = events(run_dir, "decision")
    assert [d["rung"] for d in decisions] == ["dump", "exit"] and decisions[1]["kind"] == "recovery-timeout"
    assert decisions[1]["t"] - decisions[0]["t"] < 4 + 3  # the deadline, plus the controller's tick
    (recovered,) = events(run_dir, "recovered")
    assert recovered["restored_step"] == 5


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_sub_health_grace_exit_dumps_and_restarts_cleanly(tmp_path, sharded_reference):
    ckpt = tmp_path / "ckpt"
    result, out, run_dir = train(tmp_path, "subhealth", steps=STEPS, train_args=SHARDED, flags=[
        "--sub-health-policy", "grace-exit", "--save", str(ckpt), "--ckpt-every-steps", "5",
        "--persist-every-steps", "5", "--inject", "subhealth:rank=1:step=7"])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert_same_weights(sharded_reference, out)
    (report,) = events(run_dir, "sub_health")
    assert report["rank"] == 1 and report["policy"] == "grace-exit"
    decisions = events(run_dir, "decision")
    assert [(d["rung"], d["kind"]) for d in decisions] == [("dump", "sub-health"), ("exit", "sub-health-dumped")]
    (dumped,) = events(run_dir, "dump_committed")
    assert dumped["step"] in (7, 8)  # the step in flight is redone at most
    assert (ckpt / f"step_{dumped['step']:08d}" / "MANIFEST.json").exists()
    (recovered,) = events(run_dir, "recovered")
    assert recovered["restored_step"] == dumped["step"]
    assert not [e for e in events(run_dir, "rank_exited") if e.get("exit_code") not in (0, None)
                and not e.get("signal")], "a worker failed instead of being stopped"


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_sub_health_is_only_logged_under_the_default_policy(tmp_path, sharded_reference):
    result, out, run_dir = train(tmp_path, "ignored", steps=STEPS, train_args=SHARDED,
                                 flags=["--inject", "subhealth:rank=1:step=7"])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert_same_weights(sharded_reference, out)
    (report,) = events(run_dir, "sub_health")
    assert report["policy"] == "ignore"
    assert not events(run_dir, "decision")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_straggler_is_reported_as_sub_health(tmp_path):
    from tests.conftest import REPO, run_cli

    run_dir = tmp_path / "run"
    result = run_cli(["run", "--nproc-per-node", "4", "--run-dir", str(run_dir), "--straggler-factor", "3",
                      str(REPO / "tests/integration/scripts/straggler_script.py"), "2"], timeout_s=100)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    (report,) = events(run_dir, "sub_health")
    assert report["rank"] == 2 and report["reason"].startswith("straggler: median compute time 0.2")
    assert report["policy"] == "ignore" and not events(run_dir, "decision")
