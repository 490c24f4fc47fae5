"""`unbroken ckpt` on bad inputs: clean errors, no tracebacks, markup printed literally."""

from __future__ import annotations

import os

import pytest
import torch

from unbroken.checkpoint.storage import StorageTier
from unbroken.cli.main import main


def _ckpt(root):
    tier = StorageTier(root)
    tier.save_rank(10, 0, 1, {"tracked": {"model": {"w": torch.ones(3)}}})
    tier.commit(10, 1)
    return root


def _run(capsys, *args):
    code = main(["ckpt", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out + err


@pytest.mark.parametrize("name", ["x[/bold]", "y[red]z"])
def test_paths_with_rich_markup_print_literally(tmp_path, capsys, name):
    root = _ckpt(tmp_path / name)
    for action in ("verify", "ls", "show"):
        code, out = _run(capsys, action, root)
        assert code == 0, out
        assert str(root) in out, (action, out)
    (root / "step_00000010" / "rank_00000.safetensors").write_bytes(b"junk")
    code, out = _run(capsys, "verify", root)
    assert code == 1 and f"{root}/step_00000010/rank_00000.safetensors" in out, out


@pytest.mark.parametrize("action", ["ls", "show", "verify", "export"])
def test_a_file_or_dev_null_as_dir_is_a_usage_error(tmp_path, capsys, action):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    for bad in (a_file, "/dev/null"):
        code, out = _run(capsys, action, bad, "--out", tmp_path / "o.safetensors")
        assert code == 2, out
        assert f"{bad}: not a directory" in out and "Traceback" not in out, out


def test_an_unreadable_dir_is_a_usage_error(tmp_path, capsys):
    if os.geteuid() == 0:
        pytest.skip("root reads any directory")
    d = tmp_path / "locked"
    d.mkdir(mode=0)
    try:
        code, out = _run(capsys, "ls", d)
        assert code == 2 and "cannot be read" in out, out
    finally:
        d.chmod(0o700)


def test_export_onto_a_file_of_the_checkpoint_is_refused(tmp_path, capsys):
    root = _ckpt(tmp_path / "ck")
    victim = root / "step_00000010" / "rank_00000.safetensors"
    before = victim.read_bytes()
    for target in (victim, root / "step_00000010" / "MANIFEST.json", root / "latest"):
        code, out = _run(capsys, "export", root, "--out", target)
        assert code == 2 and "is part of the checkpoint" in out, out
    assert victim.read_bytes() == before
    code, out = _run(capsys, "verify", root)
    assert code == 0, out


def test_export_into_a_missing_dir_is_a_clear_error(tmp_path, capsys):
    root = _ckpt(tmp_path / "ck")
    code, out = _run(capsys, "export", root, "--out", tmp_path / "missing" / "w.safetensors")
    assert code == 2 and f"directory {tmp_path / 'missing'} does not exist" in out, out
    assert "Traceback" not in out and "SafetensorError" not in out
    code, out = _run(capsys, "export", root, "--out", tmp_path / "w.safetensors")
    assert code == 0 and (tmp_path / "w.safetensors").is_file(), out
