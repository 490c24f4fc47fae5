"""Helpers for the real-script tests: run tests/integration/scripts/real_script.py under the
launcher, and compare a run with the fault-free run of the same flags bit for bit: the final
weights and every rank's digests (its RNG streams and data position)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import REPO, run_cli
from tests.integration.helpers import assert_same_weights

SCRIPT = REPO / "tests" / "integration" / "scripts" / "real_script.py"
STEPS = 12
NPROC = 4
SHARDED = ["--optimizer", "sharded"]

#: The data sources of the issue's matrix: (a) a sampler advanced inside the step (no dropout),
#: (b) the same with per-rank seeds and dropout, (c) a StatefulDataLoader with per-rank sharding
#: (0 and 2 workers), with per-rank seeds and dropout too.
SOURCES = {
    "sampler": ["--data", "sampler", "--dropout", "0", *SHARDED],
    "per-rank-seed": ["--data", "sampler", "--per-rank-seed", *SHARDED],
    "loader": ["--data", "loader", "--num-workers", "0", "--per-rank-seed", *SHARDED],
    "loader-2-workers": ["--data", "loader", "--num-workers", "2", "--augment", "--per-rank-seed", *SHARDED],
}


def run_script(tmp: Path, name: str, source: str, *, flags: list[str] = (), steps: int = STEPS,
               timeout_s: float = 240):
    """`unbroken run` the real script; returns (CompletedProcess, weights path, run dir)."""
    out = tmp / f"{name}.safetensors"
    run_dir = tmp / f"run-{name}"
    args = ["run", "--nproc-per-node", str(NPROC), "--run-dir", str(run_dir), *flags, str(SCRIPT),
            "--steps", str(steps), "--out", str(out), *SOURCES[source]]
    return run_cli(args, timeout_s=timeout_s), out, run_dir


def assert_ok(result) -> None:
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


def assert_bit_exact(reference: Path, out: Path) -> None:
    """Final weights and every rank's digests equal the fault-free run's."""
    assert_same_weights(reference, out)
    differing = {}
    for rank in range(NPROC):
        want = json.loads(Path(f"{reference}.rank{rank}.json").read_text())
        got = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        if want != got:
            differing[rank] = sorted(k for k in want if want[k] != got.get(k))
    assert not differing, f"per-rank state differs from the fault-free run (rank: digests): {differing}"


class References:
    """Fault-free runs, one per data source, made on first use (for a module-scoped fixture)."""

    def __init__(self, tmp_path_factory) -> None:
        self._factory = tmp_path_factory
        self._outs: dict[tuple[str, int], Path] = {}

    def __call__(self, source: str, steps: int = STEPS) -> Path:
        key = (source, steps)
        if key not in self._outs:
            result, out, _ = run_script(self._factory.mktemp(f"ref-{source}"), "reference", source, steps=steps)
            assert_ok(result)
            self._outs[key] = out
        return self._outs[key]


# -- the loop-contract tests (manual path, DDP restarts): flags given as they are -----------
REAL_SCRIPT = SCRIPT


def run_real(tmp: Path, name: str, *, steps: int, script_args: list[str], flags: list[str] = (), nproc: int = 4,
             timeout_s: float = 180):
    """`unbroken run` the real script with these script arguments; returns (CompletedProcess, weights path, run dir)."""
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
