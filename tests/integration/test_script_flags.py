"""A script's own flags reach it untouched, even those spelled like a prefix of a launcher flag
(`--ckpt` of `--ckpt-every-steps`): the launcher matches only its own flags, before the script path,
and never by abbreviation."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli
from unbroken.cli.main import build_parser

# Each one a prefix of a launcher flag (or of both its spellings), and words a script might pass.
SCRIPT_ARGS = ["--ckpt", "DIR", "--pg", "3", "--hang", "2", "--first", "1", "--save-dir", "out dir", "--no",
               "--nproc-per-node", "7", "--run-dir=x", "-h", "-v", "--", "--standby", "ünï"]


def test_the_launcher_parses_only_its_flags_before_the_script() -> None:
    args = build_parser().parse_args(["run", "--nproc-per-node", "2", "--standby", "train.py", *SCRIPT_ARGS])
    assert (args.nproc_per_node, args.standby, args.script) == (2, True, "train.py")
    assert args.script_args == SCRIPT_ARGS


@pytest.mark.parametrize("flag", ["--ckpt", "--nproc", "--hang"])
def test_an_abbreviated_launcher_flag_is_refused_with_what_to_write(flag: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["run", flag, "1", "train.py"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"unknown flag {flag} before the script" in err and "after the script path" in err


@pytest.mark.timeout(120)
def test_a_script_receives_its_flags_byte_for_byte(tmp_path) -> None:
    script = tmp_path / "echo_args.py"
    out = tmp_path / "args.json"
    script.write_text("import json, sys\n"
                      f"open({str(out)!r}, 'w', encoding='utf-8').write(json.dumps(sys.argv[1:]))\n")
    result = run_cli(["run", "--nproc-per-node", "1", "--run-dir", str(tmp_path / "run"), str(script),
                      *SCRIPT_ARGS], timeout_s=100)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert json.loads(out.read_text(encoding="utf-8")) == SCRIPT_ARGS
