"""Randomized fault schedules on a real script: bit-exact whatever fails, wherever, whenever.

Each schedule (seeded, so a failure is replayed by its seed) puts one to three faults of
random kinds on random ranks at random steps and phases into a 4-rank run of
tests/integration/scripts/real_script.py with per-rank seeds, dropout and in-step data
(a sampler or a StatefulDataLoader, alternating). The final weights and every rank's digests
must equal the fault-free run's bit for bit. Seed 0 runs in the default run, 1-22 (22 more
schedules) in ``slow``.
"""

from __future__ import annotations

import random

import pytest

from tests.integration.real_scripts import NPROC, STEPS, References, assert_bit_exact, assert_ok, run_script

pytest.importorskip("torchdata")

#: (kind, phases it may fire in): crashes at any phase, a hang, damaged state (rung `retry`).
KINDS = [("kill", ("compute", "sync", "update")), ("exit", ("compute", "sync", "update")),
         ("raise", ("compute", "sync")), ("hang", ("compute", "sync")), ("corrupt", ("compute",)),
         ("nan", ("compute",))]


def schedule(seed: int) -> list[str]:
    """The faults of schedule ``seed``: 1-3, at least two steps apart, on steps 1..STEPS-3. The
    first one's kind and phase rotate with the seed, so every 18 seeds cover every kind and phase."""
    rng = random.Random(seed)
    count = rng.randint(1, 3)
    steps = sorted(rng.sample(range(1, STEPS - 2, 2), count))
    faults = []
    for i, step in enumerate(steps):
        kind, phases = KINDS[seed % len(KINDS)] if i == 0 else rng.choice(KINDS)
        phase = phases[(seed // len(KINDS)) % len(phases)] if i == 0 else rng.choice(phases)
        faults.append(f"{kind}:rank={rng.randrange(NPROC)}:step={step}:at={phase}")
    return faults


def source_of(seed: int) -> str:
    return "per-rank-seed" if seed % 2 == 0 else "loader"  # the matrix's references serve here too


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return References(tmp_path_factory)


SEEDS = range(23)  # 0: the default run; 1-22: the slow set's 22 (3-22 cover every kind and phase)


def _params():
    for seed in SEEDS:
        marks = () if seed < 1 else (pytest.mark.slow,)
        yield pytest.param(seed, marks=marks, id=f"seed{seed}")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("seed", list(_params()))
def test_random_fault_schedule_is_bit_exact(tmp_path, references, seed):
    plan = ",".join(schedule(seed))
    result, out, _ = run_script(tmp_path, f"seed{seed}", source_of(seed), flags=["--inject", plan])
    assert_ok(result)
    assert_bit_exact(references(source_of(seed)), out)


def test_schedules_cover_every_kind_and_phase():
    """The slow set's 20 schedules alone put every kind, and every phase, into some run."""
    faults = [f for seed in SEEDS[3:] for f in schedule(seed)]
    assert {f.split(":")[0] for f in faults} == {k for k, _ in KINDS}
    assert {f.rsplit("at=", 1)[1] for f in faults} == {"compute", "sync", "update"}
