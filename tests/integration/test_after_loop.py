"""The end of a job (controller/loop_end.py): a rank that dies or hangs after its step loop, or in
the last step, or before the first one (issue 32, case 3).

A rank past its loop whose process is stopped (SIGSTOP from outside, while the script makes its
final save) is found within the hang timeout and killed; every rank's loop had finished, so the job
ends with exit code 0 and says so. A rank stopped before its loop ended takes the recovery ladder.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.integration.helpers import assert_same_weights, events

SCRIPT = Path(__file__).parent / "scripts" / "after_loop_script.py"
HANG_TIMEOUT_S = 5.0  # --hang-timeout-s of these runs (the calibrated default is 5 s too): the detection waited for


@pytest.mark.timeout(90)
def test_a_rank_killed_after_its_loop_ends_the_job_at_once_with_success(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli(["run", "--nproc-per-node", "2", "--run-dir", str(run_dir), str(SCRIPT)], timeout_s=80)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]  # every rank finished its loop: success
    (warning,) = events(run_dir, "exited_after_loop")
    assert (warning["rank"], warning["signal"]) == (1, signal.SIGKILL)
    assert [e["attempt"] for e in events(run_dir, "attempt_started")] == [0]  # no job restart
    assert not events(run_dir, "decision") and not events(run_dir, "restart_rank")  # no recovery
    (died,) = [e for e in events(run_dir, "rank_exited") if e["rank"] == 1]
    (finished,) = events(run_dir, "job_finished")
    # promptly: rank 0 exits as soon as it is done (the old path waited for the 60 s recovery timeout)
    assert finished["t"] - died["t"] < 30
    assert "ranks [1] exited abnormally afterwards" in finished["reason"]


def _run_and_stop(tmp_path: Path, name: str, *, point: str | None, rank: int, nproc: int = 4, steps: int = 6,
                  flags: tuple[str, ...] = (), finish_s: float = 60) -> tuple[int, str, Path, Path]:
    """`unbroken run` the script; once rank ``rank`` says it waits at ``point``, SIGSTOP its worker
    from outside (its pid from the run dir's ``rank_started`` events) and wait for the job, at
    most ``finish_s``. (exit code, output, weights, run dir); the job is killed if it overruns."""
    run_dir, out = tmp_path / f"run-{name}", tmp_path / f"{name}.safetensors"
    cmd = [sys.executable, "-m", "unbroken.cli.main", "run", "--nproc-per-node", str(nproc), "--run-dir",
           str(run_dir), "--hang-timeout-s", str(HANG_TIMEOUT_S), *flags, str(SCRIPT), "--steps", str(steps),
           "--out", str(out)]
    if point is not None:
        cmd += ["--wait-at", point, "--wait-rank", str(rank)]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # (test_checkpoint_tiers)
    lines: list[str] = []
    stopped = 0
    try:
        deadline = time.monotonic() + 90
        while point is not None and not stopped:
            line = job.stdout.readline()
            assert line and time.monotonic() < deadline, f"rank {rank} never reached {point}:\n{''.join(lines)}"
            lines.append(line)
            if f"WAITING rank={rank} at={point}" in line:
                stopped = [e["pid"] for e in events(run_dir, "rank_started") if e["rank"] == rank][-1]
                os.kill(stopped, signal.SIGSTOP)
        rest, _ = job.communicate(timeout=finish_s)
        lines.append(rest)
    except subprocess.TimeoutExpired:
        os.kill(job.pid, signal.SIGINT)  # Ctrl-C: the launcher stops its workers and frees its shared memory
        try:
            lines.append(job.communicate(timeout=20)[0])
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            lines.append(job.communicate()[0])
        raise AssertionError(f"the job did not end within {finish_s} s of the SIGSTOP of rank {rank} at "
                             f"{point}:\n{''.join(lines)[-4000:]}") from None
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
        if stopped:  # never left behind stopped (its agent kills it; this is for an agent that failed)
            try:
                os.kill(stopped, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return job.returncode, "".join(lines), out, run_dir


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The final weights of a fault-free 4-rank run of the script."""
    code, output, out, _ = _run_and_stop(tmp_path_factory.mktemp("after-loop-ref"), "reference", point=None, rank=0)
    assert code == 0, output[-3000:]
    return out


def _detected_within_the_hang_timeout(run_dir: Path, rank: int) -> dict:
    """The one hang of the run: ``rank``'s, its process stopped, found within the hang timeout of its
    agent seeing it stopped (plus the monitor's and the agent's polling)."""
    (hang,) = events(run_dir, "hang_detected")
    assert (hang["rank"], hang["process"]) == (rank, "stopped"), hang
    (status,) = [e for e in events(run_dir, "rank_status") if e["status"] == "stopped"]
    assert hang["t"] - status["t"] < HANG_TIMEOUT_S + 2, (status, hang)
    return hang


@pytest.mark.timeout(100)
def test_a_rank_stopped_after_its_loop_is_killed_within_the_hang_timeout_and_the_job_succeeds(tmp_path):
    """SIGSTOP of rank 1 after its loop, in the script's final save: rank 0 exits 0; rank 1 is killed
    within the hang timeout and the job exits 0, saying so (issue 32, case 3: it waited forever)."""
    code, output, out, run_dir = _run_and_stop(tmp_path, "after-loop", point="after-loop", rank=1, nproc=2,
                                               finish_s=45)
    assert code == 0, output[-4000:]
    assert _detected_within_the_hang_timeout(run_dir, 1)["during"] == "after-loop"
    (warning,) = events(run_dir, "exited_after_loop")
    assert (warning["rank"], warning["signal"], warning["hung"]) == (1, signal.SIGKILL, True)
    assert "rank 1 hung after its step loop" in warning["warning"]
    assert not events(run_dir, "decision") and len(events(run_dir, "attempt_started")) == 1  # no recovery
    (finished,) = events(run_dir, "job_finished")
    assert finished["exit_code"] == 0 and "rank 1 hung after its step loop" in finished["reason"], finished
    assert "job finished: " in output and "rank 1 hung after its step loop" in output  # the CLI says so too
    assert out.exists()  # rank 0's final save


@pytest.mark.timeout(150)
def test_a_rank_still_running_after_its_loop_is_killed_at_the_exit_timeout_and_the_job_succeeds(tmp_path):
    """Rank 1 sleeps (running, not stopped) after its loop for 10 minutes, as a final save or a
    destroy_process_group stuck on peers that are gone would: rank 0 exits 0; rank 1 is killed
    --exit-timeout-s after that and the job exits 0, saying so (it waited forever before)."""
    run_dir, out = tmp_path / "run", tmp_path / "out.safetensors"
    result = run_cli(["run", "--nproc-per-node", "2", "--run-dir", str(run_dir), "--exit-timeout-s", "3",
                      str(SCRIPT), "--steps", "4", "--out", str(out), "--wait-at", "after-loop", "--wait-rank", "1",
                      "--wait-s", "600"], timeout_s=130)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    (hang,) = events(run_dir, "hang_detected")
    assert (hang["rank"], hang["process"], hang["during"]) == (1, "running", "after-loop"), hang
    assert "--exit-timeout-s" in hang["why"]
    (rank0_exit,) = [e for e in events(run_dir, "rank_exited") if e["rank"] == 0]
    assert 3 <= hang["t"] - rank0_exit["t"] < 3 + 5, (rank0_exit, hang)
    (warning,) = events(run_dir, "exited_after_loop")
    assert (warning["rank"], warning["signal"], warning["hung"]) == (1, signal.SIGKILL, True)
    assert not events(run_dir, "decision") and len(events(run_dir, "attempt_started")) == 1  # no recovery
    (finished,) = events(run_dir, "job_finished")
    assert finished["exit_code"] == 0 and "rank 1 hung after its step loop" in finished["reason"], finished
    assert out.exists()


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("point, rank", [("after-loop", 3), ("after-loop", 0), ("last-step", 2),
                                         ("last-step-done", 2), ("before-first-step", 1)])
def test_a_rank_stopped_at_the_end_or_the_start_ends_the_job_promptly_with_the_right_weights(tmp_path, reference,
                                                                                         point, rank):
    """4 ranks, SIGSTOP of one: after the loop (rank 3, as the issue saw it; rank 0, after its final
    save: success, warned); in the
    last step before its reduction (recovered in flight); after its last step, once the others left
    their loops (nobody to recover with in flight: a job restart at once, not after the recovery
    timeout); before its first step (found at the hang timeout, not the first-step one). Each is found
    within the hang timeout and ends with exit code 0 and the fault-free run's final weights."""
    code, output, out, run_dir = _run_and_stop(tmp_path, point, point=point, rank=rank, finish_s=150)
    assert code == 0, output[-4000:]
    _detected_within_the_hang_timeout(run_dir, rank)
    assert_same_weights(reference, out)
    assert not events(run_dir, "recovery_timeout"), output[-4000:]
    decisions = [d["rung"] for d in events(run_dir, "decision")]
    if point == "after-loop":  # every rank's loop had finished: no recovery, a warning
        assert decisions == [] and [e["rank"] for e in events(run_dir, "exited_after_loop")] == [rank]
    elif point == "last-step":
        assert decisions == ["recover-in-place"]
    else:  # the others left their loops / nobody committed a step yet: the job restarts from its newest step
        assert decisions == ["exit"], decisions
        if point == "last-step-done":
            assert "already left their step loops" in events(run_dir, "decision")[0]["reason"]
