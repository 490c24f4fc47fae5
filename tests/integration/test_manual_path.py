"""The manual path (``job.all_reduce`` of the gradients + a plain torch optimizer) recovers in
flight as safely as ShardedOptimizer, with or without ``job.phase`` calls, 4 real gloo ranks.

``job.all_reduce`` inside a step marks ``sync``; the tracked optimizer's step pre-hook enters
``update`` (the step commits first). Each run is compared bit for bit with the fault-free run:
final weights and every rank's own state digests. The script's post-step code (a line per
step, inside the ``with job.step():`` block and after it under ``job.step_completed``) must
run exactly once per completed step through the fault.
"""

from __future__ import annotations

import pytest

from tests.integration.helpers import events
from tests.integration.real_scripts import assert_same_state, log_lines, run_real

STEPS = 12
KILL_STEP = 7
SCRIPT = ["--optimizer", "plain", "--data", "step"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    result, out, _ = run_real(tmp_path_factory.mktemp("manual-reference"), "reference", steps=STEPS,
                              script_args=SCRIPT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def _kill_recovered_in_flight(tmp_path, reference, *, phase: str, phases: bool) -> None:
    log = tmp_path / "post-step"
    script = [*SCRIPT, *(["--phases"] if phases else []), "--log", str(log)]
    result, out, run_dir = run_real(tmp_path, f"kill-{phase}", steps=STEPS, script_args=script,
                                    flags=["--inject", f"kill:rank=2:step={KILL_STEP}:at={phase}"])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert_same_state(reference, out)
    decisions = events(run_dir, "decision")
    assert decisions and all(d["rung"] == "recover-in-place" for d in decisions), decisions
    assert not events(run_dir, "attempt_started")[1:], "the job was restarted: not in flight"
    (done,) = events(run_dir, "recovered_in_flight")
    # After the commit ('update') the step rolls forward; before it, it is redone from its start.
    assert done["resume_step"] == (KILL_STEP + 1 if phase == "update" else KILL_STEP)
    for rank in range(4):
        for where in ("", ".after"):
            lines = log_lines(tmp_path / f"post-step{where}.rank{rank}")
            if rank == 2 and phase == "update":  # killed after the commit: its step 7 died with it
                expected = [s for s in range(STEPS) if s != KILL_STEP]
            else:
                expected = list(range(STEPS))
            assert lines == expected, f"rank {rank}'s post-step code{where} ran for steps {lines}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("phase,phases", [pytest.param("sync", False, marks=pytest.mark.slow), ("update", True)])
def test_manual_path_kill_recovers_in_flight_bit_exact(tmp_path, reference, phase, phases):
    _kill_recovered_in_flight(tmp_path, reference, phase=phase, phases=phases)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("phase,phases", [("compute", False), ("update", False), ("compute", True),
                                          ("sync", True)])
def test_manual_path_kill_at_every_phase_recovers_in_flight_bit_exact(tmp_path, reference, phase, phases):
    _kill_recovered_in_flight(tmp_path, reference, phase=phase, phases=phases)
