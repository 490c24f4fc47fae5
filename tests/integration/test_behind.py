"""The vote-less commit (worker/commit.py): a survivor cut inside a step's reduction while a peer
made that step's update is *behind*: it takes the updated model and optimizer from a peer and keeps
its own state from the cut, the job resumes in flight, bit-equal with the fault-free run. Where its
own state moves inside the reduction (a draw between issuing the reduction and waiting for it),
its state at the cut is not known to be its state after compute: the in-flight recovery is refused
and the job restarts from the newest checkpoint, bit-equal too.
tests/integration/scripts/behind_script.py, 3 ranks, 10 steps; rank 2 killed as it enters the update
of step 5, rank 1 waiting for that step's reduction only after the abort order came.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli
from tests.integration.helpers import assert_same_weights, events

SCRIPT = REPO / "tests" / "integration" / "scripts" / "behind_script.py"
FAULT = "kill:rank=2:step=5:at=update"


def _run(tmp: Path, name: str, script_args: list[str], flags: list[str]) -> tuple[Path, Path]:
    out, run_dir = tmp / name, tmp / f"run-{name}"
    result = run_cli(["run", "--nproc-per-node", "3", "--run-dir", str(run_dir), "--save", str(tmp / f"ckpt-{name}"),
                      "--hang-timeout-s", "30", *flags, str(SCRIPT), *script_args, "--out", str(out)], timeout_s=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, run_dir


def _check(tmp: Path, script_args: list[str]) -> Path:
    reference, _ = _run(tmp, "reference", script_args, [])
    faulted, run_dir = _run(tmp, "faulted", script_args, ["--inject", FAULT])
    for rank in (0, 1, 2):
        assert_same_weights(Path(f"{faulted}.rank{rank}.safetensors"), Path(f"{reference}.rank{rank}.safetensors"))
    return run_dir


@pytest.mark.timeout(600)
def test_a_survivor_cut_inside_a_reduction_a_peer_completed_takes_the_update_from_it(tmp_path):
    run_dir = _check(tmp_path, [])
    (cut,) = [e for e in events(run_dir, "rank_paused") if e["rank"] == 1]
    assert (cut["step"], cut["phase"], cut.get("cut_in_reduction")) == (5, "sync", "exact"), cut
    (behind,) = events(run_dir, "behind")
    assert (behind["ranks"], behind["step"]) == ([1], 5)
    (regroup,) = events(run_dir, "regroup")
    assert (regroup["resume_step"], regroup["replaced"]) == (6, [2])
    assert events(run_dir, "recovered_in_flight"), "recovered in flight"
    assert not events(run_dir, "attempt_started")[1:], "no restart"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_survivor_whose_state_moves_inside_the_reduction_is_not_resumed_from_its_cut(tmp_path):
    run_dir = _check(tmp_path, ["--draw-in-sync"])
    (refused,) = [e for e in events(run_dir, "decision") if e["rung"] == "recover-in-place"
                  and e["kind"] == "recovery-refused"]
    assert "rank 1 was cut inside the reduction of step 5" in refused["reason"], refused
    assert "moved between the start of step" in refused["reason"], refused
    assert events(run_dir, "attempt_started")[1:], "restarted from the checkpoint, not recovered in flight"
