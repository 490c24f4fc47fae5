"""`--load` / `--save` checked before any worker starts: exit 2 for what cannot be a checkpoint
directory, one clear line for an empty or missing --load (it starts fresh)."""

from __future__ import annotations

import os

import pytest

from tests.conftest import EXAMPLE
from tests.integration.helpers import events, train
from unbroken.checkpoint.launch_dirs import check_launch_dirs
from unbroken.cli.main import main


def _run(capsys, tmp_path, *flags):
    code = main(["run", "--run-dir", str(tmp_path / "run"), *map(str, flags), str(EXAMPLE)])
    return code, capsys.readouterr().err


@pytest.fixture
def a_file(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("not a directory")
    return f


@pytest.mark.parametrize("flag", ["--load", "--save"])
def test_a_file_or_dev_null_is_a_usage_error_before_any_worker(tmp_path, capsys, a_file, flag):
    for bad in (a_file, "/dev/null"):
        code, err = _run(capsys, tmp_path, flag, bad)
        assert code == 2, err
        assert f"{flag} {bad}: not a directory" in err
    assert not (tmp_path / "run" / "events.jsonl").exists()  # no controller, no worker ran


def test_a_load_dir_holding_something_else_is_a_usage_error(tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    (other / "model.pt").write_bytes(b"\x80\x04")
    code, err = _run(capsys, tmp_path, "--load", other)
    assert code == 2 and "holds no unbroken checkpoint (found: model.pt)" in err, err


@pytest.mark.parametrize("flag", ["--load", "--save"])
def test_an_unreadable_dir_is_a_usage_error(tmp_path, capsys, flag):
    if os.geteuid() == 0:
        pytest.skip("root reads and writes any directory")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0)
    try:
        code, err = _run(capsys, tmp_path, flag, locked)
        assert code == 2 and "cannot" in err, err
    finally:
        locked.chmod(0o700)


def test_a_save_dir_that_cannot_be_created_is_a_usage_error(tmp_path, capsys, a_file):
    code, err = _run(capsys, tmp_path, "--save", a_file / "sub")
    assert code == 2 and "cannot be created" in err, err


def test_a_missing_load_dir_starts_fresh_with_a_note(tmp_path):
    [note] = check_launch_dirs(None, str(tmp_path / "nope"))
    assert note == f"--load {tmp_path / 'nope'}: no such directory yet: starting fresh (nothing to resume)"


@pytest.mark.timeout(120)
def test_an_empty_load_dir_starts_fresh_and_says_so_once(tmp_path):
    load = tmp_path / "empty"
    load.mkdir()
    result, _, run_dir = train(tmp_path, "empty", steps=2, nproc=1, flags=["--load", str(load)])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    said = [line for line in result.stderr.splitlines() if "starting fresh" in line]
    assert said == [f"unbroken: --load {load}: empty: starting fresh (nothing to resume)"], result.stderr
    [event] = events(run_dir, "checkpoint_dirs")
    assert event["load_dir"] == str(load) and event["notes"] == [said[0].removeprefix("unbroken: ")]
