"""The resume rule: a new launch resumes only from --load; --save alone starts fresh and never
deletes checkpoints it did not write; a restart inside a run resumes from the run's own."""

from __future__ import annotations

import shutil

import pytest

from tests.integration.helpers import assert_same_weights, events, train

CKPT = ["--ckpt-every-steps", "1", "--persist-every-steps", "2"]


@pytest.fixture(scope="module")
def earlier(tmp_path_factory):
    """A directory holding the committed checkpoints of an earlier 4-step run (2 ranks)."""
    tmp = tmp_path_factory.mktemp("earlier")
    result, _, _ = train(tmp, "earlier", steps=4, nproc=2, flags=["--save", str(tmp / "ck"), *CKPT])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (tmp / "ck" / "step_00000004" / "MANIFEST.json").is_file()
    return tmp / "ck"


def _steps(ck):
    return sorted(p.parent.name for p in ck.glob("step_*/MANIFEST.json"))


@pytest.mark.timeout(240)
def test_save_alone_starts_fresh_says_so_and_keeps_checkpoints_it_did_not_write(tmp_path, earlier):
    ck = tmp_path / "ck"
    shutil.copytree(earlier, ck)
    before = _steps(ck)
    result, out, run_dir = train(tmp_path, "again", steps=6, nproc=2,
                                 flags=["--save", str(ck), *CKPT, "--keep-checkpoints", "1"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "that this launch does not load" in result.stderr and "starting fresh" in result.stderr
    assert not events(run_dir, "restored")  # fresh: nothing restored
    after = _steps(ck)
    assert after == before + ["step_00000006"], (before, after)  # kept; --keep-checkpoints 1 counts this run's
    for step in before:  # neither deleted nor written over
        assert (ck / step / "MANIFEST.json").read_bytes() == (earlier / step / "MANIFEST.json").read_bytes()
    clean, ref, _ = train(tmp_path, "clean", steps=6, nproc=2)
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
    assert_same_weights(out, ref)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_load_a_save_b_resumes_from_a_and_a_restart_inside_the_run_from_its_own(tmp_path, earlier):
    load = tmp_path / "a"
    shutil.copytree(earlier, load)
    save = tmp_path / "b"
    result, out, run_dir = train(tmp_path, "resumed", steps=8, nproc=2, flags=[
        "--load", str(load), "--save", str(save), *CKPT, "--recover-strategy", "exit",
        "--inject", "kill:rank=1:step=6"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    restored = events(run_dir, "restored")
    first = [e for e in restored if e["attempt"] == 0]
    assert {(e["step"], e["tier"], e["dir"]) for e in first} == {(4, "storage", str(load))}, restored
    later = [e for e in restored if e["attempt"] == 1]
    assert len(later) == 2 and all(e["step"] >= 5 and e["dir"] != str(load) for e in later), restored
    assert _steps(load) == _steps(earlier)  # --load's directory is only read
    # The same resume without the fault (the LR schedule depends on --steps, so a fresh 8-step
    # run is not the reference: one resumed from the same step is).
    shutil.copytree(earlier, tmp_path / "a2")
    clean, ref, _ = train(tmp_path, "clean", steps=8, nproc=2, flags=["--load", str(tmp_path / "a2")])
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
    assert_same_weights(out, ref)
