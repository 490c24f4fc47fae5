"""Generated user scripts, each faulted from outside, end bit-equal with their fault-free run (issue 32).

The generator (tests/integration/generator/) renders a training script from independent choices
(wrapper, model, data, RNG seeding, extras), runs it under `unbroken run` fault-free (once per
combination) and again with a SIGKILL or SIGSTOP of one rank's worker at a moment read from the
script's own progress lines, and compares every rank's final weights bit for bit. A case passes
(exit 0, bit-equal), or its combination is refused up front with unbroken's fatal line (the rule:
``driver.refusal``); anything else fails, and exit 0 with different weights most of all.

The default run: the fixed sample of ``samples.DEFAULT_CASES`` (every wrapper, both kinds, every
moment). The slow set: ``UNBROKEN_GEN_COUNT`` (60) cases drawn from ``UNBROKEN_GEN_SEED`` (32); a
failure's message says how to replay it alone. The same as a table:
``python -m tests.integration.generator --seed 32 --count 60 --table``.
"""

from __future__ import annotations

import os

import pytest

from tests.integration.generator.driver import Case, Combo, References, run_case, sample
from tests.integration.generator.render import RULES, STEPS, WRAPPERS, all_combos, render, skip_reason
from tests.integration.generator.samples import DEFAULT_CASES, DEFAULT_COUNT, DEFAULT_SEED

pytest.importorskip("torchdata")

SEED = int(os.environ.get("UNBROKEN_GEN_SEED", DEFAULT_SEED))
COUNT = int(os.environ.get("UNBROKEN_GEN_COUNT", DEFAULT_COUNT))


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Fault-free runs of the combinations, shared by every case of this module."""
    return References(tmp_path_factory.mktemp("gen-references"))


def _check(case: Case, references: References, tmp_path, replay: str, allowed=("pass", "refused")) -> None:
    outcome = run_case(case, references, tmp_path / "case")
    print(f"{outcome.result}: {case.key}: {outcome.detail}")
    assert outcome.result in allowed, (
        f"{case.key}: {outcome.result}: {outcome.detail}\n"
        f"replay: python -m tests.integration.generator --case '{case.key}'   ({replay})")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("key", DEFAULT_CASES)
def test_default_sample(tmp_path, references, key):
    """Each fixed case has one outcome: refused for the stock epoch counter, else bit-equal."""
    case = Case.parse(key)
    expected = ("refused",) if case.combo.data == "loader-counter" else ("pass",)
    _check(case, references, tmp_path, "the default sample", allowed=expected)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("index", range(COUNT))
def test_random_sample(tmp_path, references, index):
    case = sample(SEED, COUNT)[index]
    print(f"UNBROKEN_GEN_SEED={SEED} UNBROKEN_GEN_COUNT={COUNT} case {index}: {case.key}")
    _check(case, references, tmp_path, f"seed {SEED}, case {index} of {COUNT}")


def test_every_combination_renders_a_script_that_compiles():
    combos = all_combos()
    assert len(combos) == len(set(combos)) > 900
    for combo in combos:
        compile(render(combo), combo.key, "exec")
        assert Combo.parse(combo.key) == combo


def test_only_the_listed_rules_rule_combinations_out():
    ruled_out = [c for c in _every_product() if skip_reason(c)]
    assert {c.wrapper for c in ruled_out} == {"pp", "tp"}  # pipeline x BatchNorm / accumulation, TP x clip
    assert len(ruled_out) + len(all_combos()) == len(_every_product())
    assert len(RULES) == 3


def _every_product() -> list[Combo]:
    import itertools

    from tests.integration.generator.render import DATA, EXTRAS, MODELS, RNG
    extras = [tuple(e for e, on in zip(EXTRAS, bits) if on) for bits in itertools.product((0, 1), repeat=len(EXTRAS))]
    return [Combo(*axes) for axes in itertools.product(WRAPPERS, MODELS, DATA, RNG, extras)]


def test_samples_are_reproducible_and_cover_every_wrapper_kind_and_moment():
    cases = sample(SEED, COUNT)
    assert [c.key for c in cases] == [c.key for c in sample(SEED, COUNT)]
    assert all(Case.parse(c.key) == c for c in cases)
    assert len({c.combo for c in cases}) == len(cases)  # distinct combinations
    first = cases[:32]
    assert {c.combo.wrapper for c in first} == set(WRAPPERS)
    assert {c.fault.moment for c in first} == {"before-first-step", "mid", "last-step", "after-loop"}
    assert {c.fault.kind for c in cases} == {"SIGKILL", "SIGSTOP"}
    assert all(0 <= c.fault.rank < c.combo.nproc and (c.fault.step is None or 1 <= c.fault.step <= STEPS - 2)
               for c in cases)
    default = [Case.parse(k) for k in DEFAULT_CASES]
    assert len(default) >= 8 and {c.combo.wrapper for c in default} == set(WRAPPERS)
