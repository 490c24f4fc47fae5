"""Helpers for the multi-process tests: run the example under the launcher, compare weights."""

from __future__ import annotations

import re
import shutil
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


def reference_run(tmp_path_factory, name: str = "reference", *, steps: int, train_args: list[str] = (),
                  nproc: int = 4, flags: list[str] = ()) -> Path:
    """Final weights of a fault-free run of the example on ``nproc`` ranks (for a module-scoped fixture).

    Run once per test session for each (steps, train_args, nproc, flags): test modules that compare
    with the same fault-free run share it (a 4-rank run costs 15-50 s of the default run)."""
    parts = [str(steps), *train_args, *([f"n{nproc}"] if nproc != 4 else []), *flags]
    key = re.sub(r"[^A-Za-z0-9_.-]+", "_", "-".join(parts))
    shared = tmp_path_factory.getbasetemp() / "references" / f"{key}.safetensors"
    if shared.exists():
        return shared
    result, out, _ = train(tmp_path_factory.mktemp(name), "reference", steps=steps, train_args=train_args,
                           nproc=nproc, flags=flags)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    shared.parent.mkdir(exist_ok=True)
    shutil.copyfile(out, shared)
    return shared


def run_and_sigstop(cmd: list[str], run_dir: Path, *, rank: int, after_step: int, start_s: float,
                    finish_s: float) -> tuple[int, str]:
    """Start `unbroken run` (``cmd``), SIGSTOP ``rank``'s worker once rank 0 printed step
    ``after_step``, wait for the job; (exit code, output). The job is killed if it overruns."""
    import os
    import signal
    import subprocess
    import time

    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + start_s
        while True:
            line = job.stdout.readline()
            assert line and time.monotonic() < deadline, f"the job never reached step {after_step}"
            if f"[rank 0] step {after_step}:" in line:
                break
        pid = next(e["pid"] for e in events(run_dir, "rank_started") if e["rank"] == rank)
        os.kill(pid, signal.SIGSTOP)
        output, _ = job.communicate(timeout=finish_s)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
    return job.returncode, output


def check_in_flight(returncode: int, output: str, run_dir, replaced: set[int]) -> dict:
    """Recovered in flight only: rung recover-in-place, one attempt, no checkpoint read, survivors'
    pids unchanged; returns the last `recovered_in_flight` event."""
    assert returncode == 0, output[-5000:]
    decisions = events(run_dir, "decision")
    assert decisions and {d["rung"] for d in decisions} == {"recover-in-place"}, decisions
    assert len(events(run_dir, "attempt_started")) == 1, "the job was restarted: not in flight"
    assert not events(run_dir, "restored"), "a checkpoint was read during an in-flight recovery"
    first, last = {}, {}
    for e in events(run_dir, "rank_started"):
        first.setdefault(e["rank"], e["pid"])
        last[e["rank"]] = e["pid"]
    assert {r: p for r, p in first.items() if r not in replaced} == \
           {r: p for r, p in last.items() if r not in replaced}, "a survivor's process changed"
    assert {r for r in first if first[r] != last[r]} == replaced, (first, last)
    done = events(run_dir, "recovered_in_flight")[-1]
    assert set(done["replaced"]) <= replaced and done["steps_redone"] == 0, done
    return done


def check_trained_in_flight(trained: tuple, reference: Path, replaced: set[int]) -> dict:
    """:func:`check_in_flight` of a run made by a test module's ``_train`` ((result, out, run_dir)),
    and its final weights equal to ``reference``'s bit for bit; returns the in-flight decision."""
    result, out, run_dir = trained
    done = check_in_flight(result.returncode, result.stdout + result.stderr, run_dir, replaced)
    assert_same_weights(reference, out)
    return done
