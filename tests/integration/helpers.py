"""Helpers for the multi-process tests: run the example under the launcher, compare weights."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file

from tests.conftest import EXAMPLE, run_cli

TRAIN_ARGS = ["--optimizer", "plain"]


def train(tmp: Path, name: str, *, steps: int, nproc: int = 4, flags: list[str] = (),
          env: dict | None = None, timeout_s: float = 150, train_args: list[str] = ()):
    """`unbroken run` the example; returns (CompletedProcess, weights path, run dir)."""
    out = tmp / f"{name}.safetensors"
    run_dir = tmp / f"run-{name}"
    args = ["run", "--nproc-per-node", str(nproc), "--run-dir", str(run_dir), *flags, str(EXAMPLE),
            "--steps", str(steps), "--out", str(out), *TRAIN_ARGS, *train_args]
    return run_cli(args, timeout_s=timeout_s, env=env), out, run_dir


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(str(a)), load_file(str(b))
    assert wa.keys() == wb.keys()
    differing = [k for k in wa if not (wa[k].dtype == wb[k].dtype and wa[k].shape == wb[k].shape
                                       and bool((wa[k] == wb[k]).all()))]
    assert not differing, f"weights differ from the fault-free run in {differing}"


def events(run_dir: Path, name: str | None = None) -> list[dict]:
    from unbroken.controller.eventlog import read_events

    return [e for e in read_events(run_dir) if name is None or e["event"] == name]


def reference_run(tmp_path_factory, name: str = "reference", *, steps: int, train_args: list[str] = ()) -> Path:
    """Final weights of a fault-free 4-rank run (for a module-scoped fixture)."""
    result, out, _ = train(tmp_path_factory.mktemp(name), "reference", steps=steps, train_args=train_args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out
