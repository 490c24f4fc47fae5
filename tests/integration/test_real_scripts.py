"""Scripts written the way people write them stay bit-exact through every recovery path.

Real 4-rank gloo runs of tests/integration/scripts/real_script.py: state changed inside the
step (a sampler, a StatefulDataLoader), per-rank seeds with dropout. Every faulty run is
compared with the fault-free run of the same flags: final weights and every rank's own
digests (RNG streams, data position), bit for bit. The default run has one representative;
the rest of the matrix is ``slow``.
"""

from __future__ import annotations

import pytest

from tests.integration.helpers import events
from tests.integration.real_scripts import STEPS, References, assert_bit_exact, assert_ok, run_script

pytest.importorskip("torchdata")


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return References(tmp_path_factory)


def _flags(scenario: str, tmp) -> list[str]:
    """The launcher flags of one fault scenario (fault at step 5 of 12)."""
    ckpt = str(tmp / "ckpt")
    exit_only = ["--recover-strategy", "exit", "--save", ckpt]
    return {
        "kill-compute": ["--inject", "kill:rank=1:step=5:at=compute"],
        "kill-sync": ["--inject", "kill:rank=1:step=5:at=sync"],
        "kill-update": ["--inject", "kill:rank=1:step=5:at=update"],
        "hang": ["--inject", "hang:rank=2:step=5"],
        "kill-rank-0": ["--inject", "kill:rank=0:step=5:at=sync"],
        "summaries-kill-sync": ["--node-summaries", "--inject", "kill:rank=1:step=7:at=sync"],
        "summaries-hang": ["--node-summaries", "--inject", "hang:rank=2:step=7"],
        "two-kills": ["--inject", "kill:rank=1:step=5:at=compute,kill:rank=2:step=5:at=compute"],
        "retry": ["--inject", "corrupt:rank=2:step=5"],
        "restart-memory": [*exit_only, "--inject", "kill:rank=1:step=6:at=sync"],
        "dump": ["--recover-strategy", "dump,exit", "--save", ckpt, "--ckpt-every-steps", "5",
                 "--inject", "kill:rank=2:step=6:at=sync"],
        "restart-storage": [*exit_only, "--ckpt-every-steps", "0", "--persist-every-steps", "2",
                            "--inject", "kill:rank=1:step=6:at=sync"],
    }[scenario]


SCENARIOS = ["kill-compute", "kill-sync", "kill-update", "hang", "kill-rank-0", "two-kills", "retry",
             "restart-memory", "restart-storage", "dump", "load", "summaries-kill-sync", "summaries-hang"]
#: The default run's representatives (the rest of the matrix is slow): per-rank seeds, and loader
#: workers drawing augmentation (their streams); the default run's three fault schedules
#: (test_fault_schedules.py) run a script that uses every data source at once.
FAST = {("per-rank-seed", "kill-sync"), ("loader-2-workers", "kill-sync")}


def _matrix():
    for source in ("sampler", "per-rank-seed", "loader", "loader-2-workers"):
        for scenario in SCENARIOS:
            marks = () if (source, scenario) in FAST else (pytest.mark.slow,)
            yield pytest.param(source, scenario, marks=marks, id=f"{source}-{scenario}")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("source,scenario", list(_matrix()))
def test_bit_exact_through_the_fault(tmp_path, references, source, scenario):
    if scenario == "load":
        _check_load(tmp_path, references, source)
        return
    result, out, run_dir = run_script(tmp_path, scenario, source, flags=_flags(scenario, tmp_path))
    assert_ok(result)
    assert_bit_exact(references(source), out)
    restarted = bool(events(run_dir, "attempt_started")[1:])
    assert restarted == (scenario.startswith("restart-") or scenario == "dump"), "in flight unless asked"
    if scenario == "dump":  # the lost rank's file holds its own per-rank state, not its writer's
        assert events(run_dir, "dump_committed") and not events(run_dir, "dump_per_rank_fallback")
        (recovered,) = events(run_dir, "recovered")
        assert recovered["restored_step"] == events(run_dir, "dump_committed")[0]["step"]
    if scenario in ("kill-compute", "kill-sync", "kill-update", "two-kills", "kill-rank-0", "hang",
                    "summaries-kill-sync", "summaries-hang"):
        sources = [e["source"] for e in events(run_dir, "per_rank_state")]
        assert sources and not any(s.startswith("fallback") for s in sources), sources


def _check_load(tmp_path, references, source: str) -> None:
    """A previous run's checkpoint (storage, step 6 of 12) resumed with --load: the rest is exact."""
    ckpt = tmp_path / "ckpt"
    first, _, _ = run_script(tmp_path, "first", source, steps=6,
                             flags=["--save", str(ckpt), "--ckpt-every-steps", "0", "--persist-every-steps", "3"])
    assert_ok(first)
    result, out, run_dir = run_script(tmp_path, "resumed", source, flags=["--load", str(ckpt)])
    assert_ok(result)
    restored = events(run_dir, "restored")
    assert restored and all(e["step"] == 6 for e in restored), restored
    assert_bit_exact(references(source, STEPS), out)
