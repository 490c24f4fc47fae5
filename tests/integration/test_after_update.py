"""Per-rank state changed after the optimizer update (a draw after ``opt.step()``, an
``AveragedModel(use_buffers=True)`` of each rank's BatchNorm statistics): a rank killed inside its
update is not resumed from its state after compute (that misses what the update changed: exit 0
with other weights before); the in-flight recovery is refused and the job restarts from the
newest checkpoint: bit-equal. A rank killed in compute still recovers in flight, bit-equal.
tests/integration/scripts/after_update_script.py, 2 ranks, 10 steps.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli
from tests.integration.helpers import assert_same_weights, events

SCRIPT = REPO / "tests" / "integration" / "scripts" / "after_update_script.py"


def _run(tmp: Path, name: str, variant: str, flags: list[str]) -> tuple[Path, Path]:
    out, run_dir = tmp / name, tmp / f"run-{name}"
    result = run_cli(["run", "--nproc-per-node", "2", "--run-dir", str(run_dir), "--save", str(tmp / f"ckpt-{name}"),
                      *flags, str(SCRIPT), "--variant", variant, "--out", str(out)], timeout_s=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, run_dir


def _check(tmp: Path, variant: str, fault: str) -> Path:
    reference, _ = _run(tmp, "reference", variant, [])
    faulted, run_dir = _run(tmp, "faulted", variant, ["--inject", fault])
    for rank in (0, 1):
        assert_same_weights(Path(f"{faulted}.rank{rank}.safetensors"), Path(f"{reference}.rank{rank}.safetensors"))
    return run_dir


@pytest.mark.timeout(600)
def test_a_rank_killed_inside_an_update_that_moves_its_own_state_restarts_exact(tmp_path):
    run_dir = _check(tmp_path, "ema", "kill:rank=1:step=5:at=update")
    (refused,) = [e for e in events(run_dir, "decision") if e["rung"] == "recover-in-place"
                  and e["kind"] == "recovery-refused"]
    assert re.search(r"rank 1's state after computing step 5 is kept, but rank \d's own state moved after its update", refused["reason"])
    assert events(run_dir, "attempt_started")[1:], "restarted from the checkpoint, not recovered in flight"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("variant,fault,in_flight", [
    ("draw", "kill:rank=1:step=5:at=update", False),
    ("draw", "kill:rank=0:step=5:at=compute", True),
    ("ema", "kill:rank=1:step=5:at=compute", True),
])
def test_per_rank_state_moved_after_the_update_stays_exact(tmp_path, variant, fault, in_flight):
    run_dir = _check(tmp_path, variant, fault)
    assert bool(events(run_dir, "recovered_in_flight")) == in_flight
