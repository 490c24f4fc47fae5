"""Issue 32, case 4: an HSDP (2 x 2) FSDP2 script with two micro-batches per step
(``set_requires_gradient_sync(False)`` on the first), ``clip_grad_norm_`` over DTensor gradients,
LayerNorm + dropout blocks, AdamW and a warm-up LambdaLR (tests/integration/scripts/fsdp_accum_script.py),
on 4 real gloo ranks under `unbroken run`. Faults come from outside the job: SIGKILL of the worker
found by its rank in the run dir's ``rank_started`` events, sent while the survivors hold the first
micro-batch's accumulated, not yet reduced gradient. The job recovers in flight and its final weights
equal the fault-free run's bit for bit:

* step-pure batches, rank 1 killed (the default run), rank 0 killed;
* a torchdata ``StatefulDataLoader`` over ``DistributedSampler(shuffle=True)`` tracked with
  ``job.track(loader=loader)``, its iterator made before the loop, epochs rolling over before and
  after the fault (a new ``iter(loader)``, the epoch left to unbroken): killed between micro-batches, killed
  at whatever moment the next step is in (ranks 1 and 2), and both holders of a shard killed (a job
  restart from the memory tier, the iterators made before ``job.steps()`` restored the state);
* the same loop with the stock ``sampler.set_epoch(epoch)`` from a script variable (not state):
  refused up front, before the first step, with a message naming what to write.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli
from tests.integration.helpers import assert_same_weights, check_in_flight, events

SCRIPT = REPO / "tests" / "integration" / "scripts" / "fsdp_accum_script.py"
STEP_DATA = ["--data", "step", "--steps", "6"]
LOADER_DATA = ["--data", "loader", "--steps", "12", "--per-rank-seed"]  # 8 batches per rank and epoch: 4 steps


def _cmd(tmp: Path, name: str, script_args: list[str], flags: list[str] = ()) -> tuple[list[str], Path, Path]:
    out, run_dir = tmp / f"{name}.safetensors", tmp / f"run-{name}"
    cmd = [sys.executable, "-m", "unbroken.cli.main", "run", "--nproc-per-node", "4", "--run-dir", str(run_dir),
           *flags, str(SCRIPT), "--out", str(out), *script_args]
    return cmd, out, run_dir


def _reference(tmp: Path, script_args: list[str]) -> Path:
    cmd, out, _ = _cmd(tmp, "reference", script_args)
    result = run_cli(cmd[3:], timeout_s=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def step_reference(tmp_path_factory):
    return _reference(tmp_path_factory.mktemp("accum-step"), STEP_DATA)


@pytest.fixture(scope="module")
def loader_reference(tmp_path_factory):
    return _reference(tmp_path_factory.mktemp("accum-loader"), LOADER_DATA)


def kill_between_micro_batches(tmp: Path, script_args: list[str], *, rank: int | tuple[int, ...], step: int,
                               anywhere: bool = False, flags: list[str] = (),
                               timeout_s: float = 300) -> tuple[int, str, Path, Path]:
    """Run the script with a sleep after the first micro-batch; SIGKILL ``rank``'s worker (its pid from
    ``rank_started``; a tuple: each of them) once rank 0 printed that it is in that sleep at ``step``;
    wait for the job (``flags``: the launcher's).
    ``anywhere``: no sleep, the kill is sent once rank 0 printed the end of ``step`` (it lands wherever
    the next step is). Returns (exit code, output, weights path, run dir); the job's process group is
    killed if it overruns."""
    cmd, out, run_dir = _cmd(tmp, "faulty", script_args if anywhere else [*script_args, "--micro-sleep-s", "1.0"],
                             flags)
    marker = f"[rank 0] step {step}:" if anywhere else f"[rank 0] step {step} micro 0 done"
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                           start_new_session=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            line = job.stdout.readline()
            assert line and time.monotonic() < deadline, f"the job never reached step {step}:\n{''.join(lines)}"
            lines.append(line)
            if marker in line:
                break
        for r in (rank,) if isinstance(rank, int) else rank:
            os.kill(next(e["pid"] for e in events(run_dir, "rank_started") if e["rank"] == r), signal.SIGKILL)
        rest, _ = job.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
    return job.returncode, "".join(lines) + rest, out, run_dir


def _check_bit_exact(tmp: Path, reference: Path, script_args: list[str], rank: int, step: int) -> None:
    returncode, output, out, run_dir = kill_between_micro_batches(tmp, script_args, rank=rank, step=step)
    done = check_in_flight(returncode, output, run_dir, {rank})
    assert done["resume_step"] == step  # nothing of the step was committed: it is redone
    assert_same_weights(reference, out)


@pytest.mark.timeout(600)
def test_rank1_killed_while_a_gradient_is_accumulated_recovers_bit_exact(tmp_path, step_reference):
    _check_bit_exact(tmp_path, step_reference, STEP_DATA, rank=1, step=3)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rank0_killed_while_a_gradient_is_accumulated_recovers_bit_exact(tmp_path, step_reference):
    _check_bit_exact(tmp_path, step_reference, STEP_DATA, rank=0, step=2)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_stateful_loader_with_epoch_rollovers_recovers_bit_exact(tmp_path, loader_reference):
    """Killed at step 6 (epoch 1): the replacement's iterator, made before its state arrived, and the
    survivors' (rolled back) iterators follow the loader's state; epochs 2 and 3 come after the fault."""
    _check_bit_exact(tmp_path, loader_reference, LOADER_DATA, rank=1, step=6)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("rank", [1, 2])
def test_stateful_loader_rank_killed_at_any_moment_ends_bit_exact(tmp_path, loader_reference, rank):
    """The kill lands wherever the next step is (forward, backward, the clip's all-reduce, the update):
    in flight, bit-exact, whichever step it is resumed at."""
    returncode, output, out, run_dir = kill_between_micro_batches(tmp_path, LOADER_DATA, rank=rank, step=6,
                                                                  anywhere=True)
    check_in_flight(returncode, output, run_dir, {rank})
    assert_same_weights(loader_reference, out)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_stateful_loader_restarted_from_the_memory_tier_ends_bit_exact(tmp_path, loader_reference):
    """Ranks 0 and 2 (both holders of one shard) killed at step 7: no in-flight rung, the job restarts
    from the memory tier (step 5); every rank's iterator, made before job.steps() restored the state,
    and its sampler's epoch follow the checkpoint."""
    returncode, output, out, run_dir = kill_between_micro_batches(
        tmp_path, LOADER_DATA, rank=(0, 2), step=7, flags=["--save", str(tmp_path / "ckpt"), "--ckpt-every-steps", "5"])
    assert returncode == 0, output[-4000:]
    assert events(run_dir, "decision")[-1]["rung"] == "exit"
    assert {e["step"] for e in events(run_dir, "restored")} == {5}
    assert_same_weights(loader_reference, out)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_epoch_counter_that_is_not_state_is_refused_up_front(tmp_path):
    cmd, _, run_dir = _cmd(tmp_path, "counter", [*LOADER_DATA, "--epoch-from", "counter"])
    result = run_cli(cmd[3:], timeout_s=240)
    output = result.stdout + result.stderr
    assert result.returncode == 97, "a script epoch counter must be refused (EXIT_FATAL):\n" + output[-3000:]
    assert not events(run_dir, "step"), "refused up front: before the first step"
    fatal = [e["error"] for e in events(run_dir, "fatal_error")]
    assert any("sampler.set_epoch(0) on the sampler of a loader given to job.track" in e
               and "Remove the set_epoch calls" in e for e in fatal), (fatal, output[-3000:])
