"""A fault inside a reduction that follows the step's first optimizer update.

The step commits at that update, so a survivor cut inside a later reduction rolls forward without
what the step does after it. Where the script changes state there (a GAN's second optimizer, a
scheduler stepped after a logging all-reduce, a model put back in training mode after a validation
all-reduce), the survivor says so in its pause report and the
controller refuses the in-flight recovery: the job restarts from the newest checkpoint, bit-equal
(these scripts were refused at their first step before, exit 97). Where nothing follows (a logged
loss), the recovery stays in flight, bit-equal. tests/integration/scripts/tail_script.py, 2 ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli
from tests.integration.helpers import assert_same_weights, events

SCRIPT = REPO / "tests" / "integration" / "scripts" / "tail_script.py"


def _run(tmp: Path, name: str, mode: str, script_args: list[str]) -> tuple[Path, Path]:
    out, run_dir = tmp / name, tmp / f"run-{name}"
    result = run_cli(["run", "--nproc-per-node", "2", "--run-dir", str(run_dir), "--save", str(tmp / f"ckpt-{name}"),
                      str(SCRIPT), "--mode", mode, "--out", str(out), *script_args], timeout_s=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, run_dir


def _check(tmp: Path, mode: str) -> Path:
    reference, _ = _run(tmp, "reference", mode, [])
    faulted, run_dir = _run(tmp, "faulted", mode, ["--die-step", "4", "--marker", str(tmp / "died")])
    for rank in (0, 1):
        assert_same_weights(Path(f"{faulted}.rank{rank}.safetensors"), Path(f"{reference}.rank{rank}.safetensors"))
    assert [e["signal"] for e in events(run_dir, "rank_exited") if e["rank"] == 1][0] == 9
    return run_dir


def _refused_in_flight(run_dir: Path) -> bool:
    cut = [e for e in events(run_dir, "rank_paused") if e.get("cut_in_tail")]
    refused = [e for e in events(run_dir, "decision") if e["kind"] == "recovery-refused"]
    restarted = bool(events(run_dir, "attempt_started")[1:])
    assert bool(cut) == bool(refused) == restarted, (cut, refused, restarted)
    return restarted


@pytest.mark.timeout(600)
def test_a_scheduler_stepped_after_a_logging_reduction_cut_by_a_fault_restarts_exact(tmp_path):
    run_dir = _check(tmp_path, "logreduce")
    assert _refused_in_flight(run_dir)
    cut = {(e["rank"], e["step"], e["phase"]) for e in events(run_dir, "rank_paused") if e.get("cut_in_tail")}
    assert cut == {(0, 4, "update")}  # (paused on the peer's loss, then again for the abort order)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode,in_flight", [("gan", False), ("evalreduce", False), ("logonly", True)])
def test_a_fault_inside_a_reduction_after_the_update(tmp_path, mode, in_flight):
    run_dir = _check(tmp_path, mode)
    assert _refused_in_flight(run_dir) != in_flight
    assert bool(events(run_dir, "recovered_in_flight")) == in_flight
