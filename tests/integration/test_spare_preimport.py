"""The warm spare imports what the training script imported (worker/script_imports.py ->
controller -> agent -> agent/spare.py), so a replacement pays no import. Real `unbroken run`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.integration.helpers import events

SCRIPT = Path(__file__).parent / "scripts" / "preimport_script.py"
MARKER_MODULE = "import os\nwith open(os.environ['T17A_MARKER'], 'a') as f:\n    f.write(f'{os.getpid()}\\n')\n"


def _run(tmp_path: Path, *flags: str, wait_s: float) -> tuple[set[int], Path, object]:
    lib, marker, run_dir = tmp_path / "lib", tmp_path / "marker", tmp_path / "run"
    lib.mkdir()
    (lib / "preimport_marker.py").write_text(MARKER_MODULE)
    marker.write_text("")
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(lib), os.environ.get("PYTHONPATH")) if p),
           "T17A_MARKER": str(marker)}
    result = run_cli(["run", "--nproc-per-node", "1", "--run-dir", str(run_dir), *flags, str(SCRIPT), str(wait_s)],
                     env=env, timeout_s=150)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {int(p) for p in marker.read_text().split()}, run_dir, result


@pytest.mark.slow  # default run: tests/worker/test_script_imports.py, test_server_pieces.py (the report's way)
@pytest.mark.timeout(180)
def test_the_spare_imports_a_module_the_script_imported(tmp_path):
    pids, run_dir, _ = _run(tmp_path, wait_s=90)
    (worker,) = [e["pid"] for e in events(run_dir, "rank_started")]
    assert worker in pids
    assert pids - {worker}, "no other process (the warm spare) imported the script's module"
    (reported,) = events(run_dir, "script_imports")
    assert "preimport_marker" in reported["modules"] and reported["count"] == len(reported["modules"])
