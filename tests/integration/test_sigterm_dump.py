"""SIGTERM to `unbroken run --save DIR` (a pod evicted, `scancel`): the job dumps its newest
committed step to DIR, exits 143 within the grace period, and `--load DIR` resumes from it with
the fault-free run's final weights, bit for bit (issue 16). Real processes, real gloo.

Which step the dump holds: the example prints ``step s`` (rank 0) after s + 1 completed steps;
the SIGTERM sent then lands while step s + 1 (or a later one, under load) is in flight. Every
rank leaves it and the controller takes the first step not committed on every rank: the step in
flight when no rank had finished its gradient reduction (it is dropped and redone after --load),
the one after it when every rank had (the commit rule finishes it first). So the dump's step is
>= s + 1, and it is the newest complete checkpoint in DIR.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import EXAMPLE, REPO
from tests.integration.helpers import TRAIN_ARGS, assert_same_weights, events, train
from unbroken.checkpoint.storage import StorageTier

STEPS = 40
SLOW_STEPS = ["--step-sleep-s", "0.05", "--log-every", "1"]  # a step in flight most of the time
K8S_DEFAULT_GRACE_S = 30  # terminationGracePeriodSeconds when a pod does not set it


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The fault-free 2-rank run's final weights."""
    result, out, _ = train(tmp_path_factory.mktemp("sigterm-ref"), "reference", steps=STEPS, nproc=2,
                           train_args=SLOW_STEPS)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def launch(tmp: Path, name: str, flags: list[str], nproc: int = 2, env: dict | None = None) -> subprocess.Popen:
    run_dir = tmp / f"run-{name}"
    cmd = [sys.executable, "-m", "unbroken.cli.main", "run", "--nproc-per-node", str(nproc), "--run-dir",
           str(run_dir), *flags, str(EXAMPLE), "--steps", str(STEPS), "--out", str(tmp / f"{name}.safetensors"),
           *TRAIN_ARGS, *SLOW_STEPS]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            start_new_session=True, env=dict(os.environ, **(env or {})))


def wait_for_line(job: subprocess.Popen, prefix: str, seen: list[str], timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    for line in job.stdout:
        seen.append(line)
        if line.startswith(prefix):
            return
        assert time.monotonic() < deadline, f"no {prefix!r} within {timeout_s} s:\n{''.join(seen[-40:])}"
    raise AssertionError(f"the job ended before {prefix!r}:\n{''.join(seen[-40:])}")


def finish(job: subprocess.Popen, seen: list[str], timeout_s: float = 60) -> str:
    try:
        rest, _ = job.communicate(timeout=timeout_s)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
    return "".join(seen) + rest


def sigterm_at_step(job: subprocess.Popen, step: int, seen: list[str]) -> float:
    """SIGTERM to the launcher once rank 0 printed ``step``; returns when it was sent."""
    try:
        wait_for_line(job, f"[rank 0] step {step}:", seen)
    except BaseException:
        finish(job, seen, timeout_s=1)
        raise
    job.send_signal(signal.SIGTERM)
    return time.monotonic()


@pytest.mark.timeout(480)  # three launches (with the reference); ~100 s on 2 loaded cores, 300 s at load 35
def test_sigterm_dumps_the_newest_step_and_load_resumes_bit_exact(tmp_path, reference):
    s = random.randint(3, 15)  # where the signal comes, differently each run
    ckpt, seen = tmp_path / "ckpt", []
    job = launch(tmp_path, "terminated", ["--save", str(ckpt)])
    sent = sigterm_at_step(job, s, seen)
    output = finish(job, seen)
    stopped_s = time.monotonic() - sent
    assert job.returncode == 143, f"s={s}\n{output[-4000:]}"
    assert stopped_s < K8S_DEFAULT_GRACE_S, f"took {stopped_s:.1f} s to stop"
    run_dir = tmp_path / "run-terminated"
    (terminating,) = events(run_dir, "terminating")
    assert terminating["dump"], terminating
    (dumped,) = events(run_dir, "dump_committed")
    step = dumped["step"]
    assert s + 1 <= step < STEPS, f"s={s}: dumped step {step}"
    tier = StorageTier(ckpt)
    assert tier.committed_steps()[0] == step and tier.verify_step(step) == []  # complete, every checksum good
    assert "was dumped to --save" in output and f"step {step}" in output
    assert not (tmp_path / "terminated.safetensors").exists()  # the job really stopped mid-run

    result, out, resumed_dir = train(tmp_path, "resumed", steps=STEPS, nproc=2, flags=["--load", str(ckpt)],
                                     train_args=SLOW_STEPS)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert {e["step"] for e in events(resumed_dir, "restored")} == {step}
    assert_same_weights(reference, out)


def hang_in_every_dump(rank: int) -> str:
    """A fault plan that hangs ``rank`` when it writes a dump, whatever its step (with the memory
    tier on, the checkpoint phase of a step is reached only by a dump or job.checkpoint())."""
    return ",".join(f"hang:rank={rank}:step={k}:at=checkpoint" for k in range(1, STEPS))


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_dump_that_cannot_finish_in_time_stops_the_job_and_commits_nothing(tmp_path):
    ckpt, seen = tmp_path / "ckpt", []
    job = launch(tmp_path, "cut", ["--save", str(ckpt), "--sigterm-dump-timeout-s", "3",
                                   "--inject", hang_in_every_dump(1)])
    sent = sigterm_at_step(job, 3, seen)
    output = finish(job, seen)
    stopped_s = time.monotonic() - sent
    assert job.returncode == 143, output[-4000:]
    assert 3 <= stopped_s < 3 + 10, f"took {stopped_s:.1f} s"
    run_dir = tmp_path / "run-cut"
    (order,) = events(run_dir, "dump")
    assert not events(run_dir, "dump_committed")
    (finished,) = events(run_dir, "job_finished")
    assert "the dump did not finish within 3 s (--sigterm-dump-timeout-s)" in finished["reason"]
    # Rank 0 wrote its part of the step; without the manifest no --load takes it.
    step_dir = ckpt / f"step_{order['step']:08d}"
    assert step_dir.is_dir() and not (step_dir / "MANIFEST.json").exists()
    assert order["step"] not in StorageTier(ckpt).committed_steps()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_after_a_cut_dump_load_resumes_from_the_older_checkpoint_bit_exact(tmp_path, reference):
    ckpt, seen = tmp_path / "ckpt", []
    job = launch(tmp_path, "cut", ["--save", str(ckpt), "--sigterm-dump-timeout-s", "3",
                                   "--persist-every-steps", "5", "--inject", hang_in_every_dump(1)])
    sigterm_at_step(job, 12, seen)
    output = finish(job, seen)
    assert job.returncode == 143, output[-4000:]
    (order,) = events(tmp_path / "run-cut", "dump")
    older = StorageTier(ckpt).committed_steps()
    assert older and older[0] < order["step"]
    result, out, resumed_dir = train(tmp_path, "resumed", steps=STEPS, nproc=2, flags=["--load", str(ckpt)],
                                     train_args=SLOW_STEPS)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert {e["step"] for e in events(resumed_dir, "restored")} == {older[0]}
    assert_same_weights(reference, out)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_second_sigterm_during_the_dump_stops_at_once(tmp_path):
    ckpt, seen = tmp_path / "ckpt", []
    job = launch(tmp_path, "twice", ["--save", str(ckpt), "--sigterm-dump-timeout-s", "60",
                                     "--inject", hang_in_every_dump(1)])
    sigterm_at_step(job, 3, seen)
    deadline = time.monotonic() + 30
    while not events(tmp_path / "run-twice", "dump"):  # the dump is under way (and hangs)
        assert time.monotonic() < deadline and job.poll() is None, "no dump order"
        time.sleep(0.1)
    job.send_signal(signal.SIGTERM)
    second = time.monotonic()
    output = finish(job, seen)
    assert job.returncode == 143, output[-4000:]
    assert time.monotonic() - second < 30  # not the 60 s the dump had: the stop only (3 s grace, the exit)
    assert not events(tmp_path / "run-twice", "dump_committed")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_to_another_nodes_agent_dumps_the_whole_job(tmp_path, reference):
    """Two nodes on one machine; only node 1's agent gets SIGTERM (its pod is evicted): the
    controller on node 0 dumps the job, both agents exit 143."""
    from tests.conftest import free_port

    ckpt, port = tmp_path / "ckpt", free_port()
    env = {"UNBROKEN_JOB_SECRET": "sigterm-test-" + "0123456789abcdef" * 2}
    common = ["--nnodes", "2", "--master-port", str(port), "--save", str(ckpt)]
    node0 = launch(tmp_path, "node0", [*common, "--node-rank", "0"], nproc=1, env=env)
    node1 = launch(tmp_path, "node1", [*common, "--node-rank", "1"], nproc=1, env=env)
    seen0: list[str] = []
    try:
        wait_for_line(node0, "[rank 0] step 6:", seen0)
        node1.send_signal(signal.SIGTERM)
        output0 = finish(node0, seen0)
    finally:
        output1 = finish(node1, [])
    assert (node0.returncode, node1.returncode) == (143, 143), output0[-3000:] + output1[-3000:]
    (dumped,) = events(tmp_path / "run-node0", "dump_committed")
    assert "on node 1" in events(tmp_path / "run-node0", "terminating")[0]["reason"]
    result, out, _ = train(tmp_path, "resumed", steps=STEPS, nproc=2, flags=["--load", str(ckpt)],
                           train_args=SLOW_STEPS)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert_same_weights(reference, out)
    assert dumped["step"] >= 7
