"""Helpers for the tests that run tests/integration/scripts/real_script.py under the launcher."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_cli
from tests.integration.helpers import assert_same_weights

REAL_SCRIPT = Path(__file__).parent / "scripts" / "real_script.py"


def run_real(tmp: Path, name: str, *, steps: int, script_args: list[str], flags: list[str] = (), nproc: int = 4,
             timeout_s: float = 180):
    """`unbroken run` the real script; returns (CompletedProcess, weights path, run dir)."""
    out = tmp / f"{name}.safetensors"
    run_dir = tmp / f"run-{name}"
    args = ["run", "--nproc-per-node", str(nproc), "--run-dir", str(run_dir), *flags, str(REAL_SCRIPT),
            "--steps", str(steps), "--out", str(out), *script_args]
    return run_cli(args, timeout_s=timeout_s), out, run_dir


def assert_same_state(reference: Path, out: Path, nproc: int = 4) -> None:
    """The weights and every rank's own state digests (RNG streams, data position) are equal."""
    assert_same_weights(reference, out)
    for rank in range(nproc):
        want = json.loads(Path(f"{reference}.rank{rank}.json").read_text())
        got = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        assert got == want, f"rank {rank}'s own state differs from the fault-free run: {got} != {want}"


def log_lines(path: Path) -> list[int]:
    return [int(line) for line in path.read_text().split()] if path.exists() else []
