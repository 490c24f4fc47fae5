"""Pre-run spares (`unbroken run --prerun-spares`) with real gloo ranks: the spare has run the
script up to ``job.steps()`` before the fault (worker/prerun.py, agent/prerun.py).

The job is held at a step (tests/integration/scripts/prerun_script.py) until the spare reported
ready; the test then SIGKILLs a rank and opens the gate, so the kill always finds a ready spare,
and the step count is the fault-free run's: the final weights must be equal bit for bit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from tests.integration.helpers import assert_same_weights, check_in_flight, events

SCRIPT = Path(__file__).parent / "scripts" / "prerun_script.py"
STEPS = 6
FLAGS = ["--hang-timeout-s", "300", "--first-step-timeout-s", "300"]  # a held job is not hung


@contextmanager
def _started(tmp: Path, name: str, nproc: int, *, holds: tuple[int, ...] = (), flags: list[str] = (),
             script_args: list[str] = ()) -> Iterator[tuple[subprocess.Popen, Path, Path, Path]]:
    """`unbroken run` the script; the job is killed on the way out if it is still running."""
    gates, run_dir, out = tmp / f"gates-{name}", tmp / f"run-{name}", tmp / f"{name}.safetensors"
    gates.mkdir()
    for step in holds:
        (gates / f"{step}.hold").touch()
    cmd = [sys.executable, "-m", "unbroken.cli.main", "run", "--nproc-per-node", str(nproc), "--run-dir",
           str(run_dir), *FLAGS, *flags, str(SCRIPT), str(out), str(STEPS), str(gates), *script_args]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        yield job, run_dir, out, gates
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()


def _finish(job: subprocess.Popen, timeout_s: float) -> str:
    return job.communicate(timeout=timeout_s)[0]


def _wait_event(job: subprocess.Popen, run_dir: Path, name: str, count: int = 1, timeout_s: float = 150) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = events(run_dir, name) if (run_dir / "events.jsonl").exists() else []
        if len(found) >= count:
            return found
        if name == "spare_ready" and (run_dir / "events.jsonl").exists():
            assert not events(run_dir, "prerun_failed"), events(run_dir, "prerun_failed")
        assert job.poll() is None, f"the job ended (exit {job.returncode}) before event {name!r}"
        time.sleep(0.1)
    raise AssertionError(f"no {count} {name!r} event(s) within {timeout_s} s")


def _kill_rank(run_dir: Path, rank: int) -> int:
    pid = [e["pid"] for e in events(run_dir, "rank_started") if e["rank"] == rank][-1]
    os.kill(pid, signal.SIGKILL)
    return pid


def _reference(tmp: Path, nproc: int) -> Path:
    with _started(tmp, f"reference-{nproc}", nproc) as (job, _, out, _):
        output = _finish(job, 150)
    assert job.returncode == 0, output[-4000:]
    return out


def _kill_and_release(job, run_dir: Path, gates: Path, rank: int, step: int, nproc: int = 4) -> None:
    """Once every rank is held before ``step``: SIGKILL ``rank``, open the gate."""
    deadline = time.monotonic() + 120
    while not all((gates / f"at{step}-rank{r}").exists() for r in range(nproc)):
        assert job.poll() is None and time.monotonic() < deadline, f"the ranks never reached step {step}"
        time.sleep(0.05)
    _kill_rank(run_dir, rank)
    (gates / str(step)).touch()


def _replacement_phases(run_dir: Path) -> list[dict]:
    return [e for e in events(run_dir, "restore_phases") if e["role"] == "replacement"]


def _check_prerun_took_over(run_dir: Path, ready: dict, rank: int) -> None:
    """The replacement of ``rank`` is the process that reported ready, blocked at job.steps(),
    and its own script ran (almost) nothing after the order."""
    assert ready["where"] == "job.steps()", ready
    assert [e["pid"] for e in events(run_dir, "rank_started") if e["rank"] == rank][-1] == ready["pid"]
    assert not events(run_dir, "prerun_failed")


def _one_kill(tmp: Path, name: str, nproc: int, rank: int, script_args: list[str] = ()) -> tuple:
    """A job with --prerun-spares held at step 3: once the spare is ready (or, with ``script_args``
    that make it fail, once it failed), ``rank`` is killed there; (first spare event, output, run dir, out)."""
    wanted = "prerun_failed" if script_args else "spare_ready"
    with _started(tmp, name, nproc, holds=(3,), flags=["--prerun-spares"], script_args=script_args) as \
            (job, run_dir, out, gates):
        (spare_event,) = _wait_event(job, run_dir, wanted)
        _kill_and_release(job, run_dir, gates, rank=rank, step=3, nproc=nproc)
        output = _finish(job, 150)
    check_in_flight(job.returncode, output, run_dir, {rank})
    return spare_event, run_dir, out


@pytest.mark.timeout(240)
def test_a_prerun_spare_replaces_a_killed_rank_in_flight(tmp_path):
    """Default run's representative (2 ranks, one job: no reference run, for CI time): the pre-run
    spare takes over and ends with the survivor's weights bit for bit (the slow 4-rank case below
    compares with the fault-free run)."""
    ready, run_dir, out = _one_kill(tmp_path, "kill", 2, rank=1)
    assert_same_weights(Path(f"{out}.rank0"), Path(f"{out}.rank1"))
    _check_prerun_took_over(run_dir, ready, 1)
    (phases,) = _replacement_phases(run_dir)
    assert phases["script_s"] < 0.2, phases  # init() -> job.steps() after the order: the track replay only


@pytest.mark.slow  # default run: the 2-rank case above (no reference run there)
@pytest.mark.timeout(300)
def test_a_prerun_spare_replaces_a_killed_rank_of_four_bit_exact(tmp_path):
    reference = _reference(tmp_path, 4)
    ready, run_dir, out = _one_kill(tmp_path, "kill4", 4, rank=2)
    assert_same_weights(reference, out)
    _check_prerun_took_over(run_dir, ready, 2)
    assert _replacement_phases(run_dir)[0]["script_s"] < 0.2


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_two_kills_in_a_row_each_replaced_by_a_new_prerun_spare(tmp_path):
    reference = _reference(tmp_path, 4)
    with _started(tmp_path, "two", 4, holds=(2, 4), flags=["--prerun-spares"]) as (job, run_dir, out, gates):
        (first,) = _wait_event(job, run_dir, "spare_ready")
        _kill_and_release(job, run_dir, gates, rank=1, step=2)
        second = _wait_event(job, run_dir, "spare_ready", count=2)[1]
        _wait_event(job, run_dir, "recovered_in_flight")
        _kill_and_release(job, run_dir, gates, rank=3, step=4)
        output = _finish(job, 150)
    check_in_flight(job.returncode, output, run_dir, {1, 3})
    assert_same_weights(reference, out)
    assert second["pid"] != first["pid"]
    started = {e["pid"]: e["rank"] for e in events(run_dir, "rank_started")}
    assert (started.get(first["pid"]), started.get(second["pid"])) == (1, 3)
    assert len(events(run_dir, "recovered_in_flight")) == 2 and not events(run_dir, "prerun_failed")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_script_reading_rank_early_falls_back_to_a_warm_spare_bit_exact(tmp_path):
    reference = _reference(tmp_path, 4)
    failed, run_dir, out = _one_kill(tmp_path, "early", 4, rank=2, script_args=["--read-rank-early"])
    assert_same_weights(reference, out)
    assert failed["exit_code"] == 1 and failed["where"] == "", failed
    assert any("KeyError: 'RANK'" in line for line in failed["last_lines"]), failed
    assert not events(run_dir, "spare_ready")
