"""bf16 autocast with a tracked GradScaler, a rank killed after the backward: bit-equal (a probe of
unseen scripts, 2026-12-06).

A survivor that had unscaled its gradients (``scaler.step`` -> ``unscale_``) when the step was dropped
kept the scaler's per-step record of it (outside its state_dict), skipped the unscale in the redo and
stepped on scaled gradients: exit 0 with other weights, and ranks that differ from each other. And a
scale that overflows (the scaler skips those steps by design) was taken by the finite check for a
NaN fault and ended in a crash loop. tests/integration/scripts/amp_script.py, 2 ranks, 8 steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli
from tests.integration.helpers import assert_same_weights

SCRIPT = REPO / "tests" / "integration" / "scripts" / "amp_script.py"


def _run(tmp: Path, name: str, init_scale: float, inject: list[str]) -> Path:
    out, run_dir = tmp / name, tmp / f"run-{name}"
    result = run_cli(["run", "--nproc-per-node", "2", "--run-dir", str(run_dir), *inject, str(SCRIPT),
                      "--init-scale", str(init_scale), "--out", str(out)], timeout_s=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def _check(tmp: Path, init_scale: float, fault: str) -> None:
    reference = _run(tmp, "reference", init_scale, [])
    faulted = _run(tmp, "faulted", init_scale, ["--inject", fault])
    for rank in (0, 1):
        assert_same_weights(Path(f"{faulted}.rank{rank}.safetensors"), Path(f"{reference}.rank{rank}.safetensors"))


@pytest.mark.timeout(600)
def test_a_rank_killed_after_the_scaled_backward_is_recovered_bit_exact(tmp_path):
    _check(tmp_path, 1024.0, "kill:rank=1:step=4:at=vote")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("fault", ["kill:rank=1:step=4:at=sync", "hang:rank=0:step=3:at=vote"])
def test_an_overflowing_scale_trains_and_recovers_bit_exact(tmp_path, fault):
    _check(tmp_path, 2.0 ** 127, fault)
