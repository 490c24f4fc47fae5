"""In-flight recovery with lazily connected groups (`--lazy-connect`) on 6 real gloo ranks.

The survivors build the next generation's groups while they wait for the regroup order
(Fabric.prepare), and a survivor in no move of the transfer (the example's three pieces go from
ranks 0-2, so ranks 3 and 4 send nothing) builds nothing more until the movers are done
(comm/movers.py). The result must not change: the same weights as the fault-free run, bit for bit.
"""

from __future__ import annotations

import pytest

from tests.integration.helpers import assert_same_weights, events, reference_run, train

NPROC, STEPS = 6, 10
LAZY = ["--lazy-connect"]


@pytest.fixture(scope="module")
def lazy_reference(tmp_path_factory):
    return reference_run(tmp_path_factory, "lazy-reference", steps=STEPS, nproc=NPROC, flags=LAZY)


def _recovered_with_a_deferred_survivor(result, run_dir, replaced: list[int]) -> list[dict]:
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert not events(run_dir, "attempt_started")[1:], "the job was restarted: not in flight"
    assert events(run_dir, "recovered_in_flight")[-1]["replaced"] == replaced
    phases = events(run_dir, "restore_phases")
    deferred = [e for e in phases if "deferred_s" in e]
    assert deferred, f"no survivor waited for the movers: {phases}"
    assert {e["role"] for e in deferred} == {"survivor"} and all(e["rank"] not in replaced for e in deferred)
    assert all(e["exchange_s"] < 0.05 for e in deferred)  # (it moved nothing)
    return deferred


@pytest.mark.timeout(200)
def test_a_survivor_in_no_move_joins_after_the_transfer(tmp_path):
    result, _, run_dir = train(tmp_path, "lazy-kill", steps=STEPS, nproc=NPROC,
                               flags=[*LAZY, "--inject", "kill:rank=5:step=5:at=sync"])
    deferred = _recovered_with_a_deferred_survivor(result, run_dir, [5])
    assert sorted(e["rank"] for e in deferred) == [3, 4]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("inject", ["kill:rank=5:step=5:at=sync", "kill:rank=5:step=6:at=update",
                                    "kill:rank=5:step=5,kill:rank=5:step=5:at=restore"],
                         ids=["sync", "update", "replacement-killed-while-restoring"])
def test_lazy_in_flight_recovery_is_bit_exact(tmp_path, lazy_reference, inject):
    result, out, run_dir = train(tmp_path, "lazy", steps=STEPS, nproc=NPROC, flags=[*LAZY, "--inject", inject])
    _recovered_with_a_deferred_survivor(result, run_dir, [5])
    assert_same_weights(lazy_reference, out)
