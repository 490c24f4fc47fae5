"""The Slurm script and the cluster entrypoint, run for real on this machine.

The sbatch script runs with a fake `srun` (and `scontrol`) on PATH: one "node", a real
`unbroken run` of examples/train_gpt.py for a few steps. The entrypoint is checked on what
it adds or passes on: a fatal job exits 97, and SIGTERM reaches `unbroken run`, which dumps
its newest step to --save and exits 143.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import EXAMPLE, REPO, free_port
from tests.integration.helpers import events
from unbroken.errors import EXIT_FATAL

SBATCH = REPO / "deploy" / "slurm" / "unbroken.sbatch"
ENTRYPOINT = REPO / "deploy" / "unbroken-entrypoint.sh"
FATAL_SCRIPT = REPO / "tests" / "integration" / "scripts" / "fatal_script.py"
UNBROKEN = str(Path(sys.executable).parent / "unbroken")

# srun as far as the script uses it: --nodes=N, then the command, run once per node here
# with the variables a task gets (SLURM_NODEID ...); exit status: the highest of the tasks'.
FAKE_SRUN = """#!/usr/bin/env bash
echo "$*" >> "$FAKE_SLURM_LOG"
nodes=1
while [ $# -gt 0 ]; do
  case "$1" in --nodes=*) nodes="${1#--nodes=}" ;; -*) ;; *) break ;; esac
  shift
done
pids=()
for ((i = 0; i < nodes; i++)); do
  SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0 SLURM_NTASKS=$nodes "$@" &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || { r=$?; [ "$r" -gt "$rc" ] && rc=$r; }; done
exit "$rc"
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
echo "scontrol $*" >> "$FAKE_SLURM_LOG"
if [ "$1 $2" = "show hostnames" ]; then echo 127.0.0.1; fi
"""


def _fake_slurm(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_SLURM_LOG": str(tmp_path / "slurm.log"),
            "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "localhost",
            "SLURM_JOB_NAME": "unbroken-test", "SLURM_SUBMIT_DIR": str(REPO)}


def _run(cmd: list[str], env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, **env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{cmd} timed out after {timeout_s} s\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_scripts_parse_with_bash_n():
    for script in (SBATCH, ENTRYPOINT):
        checked = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert checked.returncode == 0, f"{script}: {checked.stderr}"


@pytest.mark.timeout(120)
def test_sbatch_script_runs_a_one_node_job_through_a_fake_srun(tmp_path):
    run_dir, save_dir = tmp_path / "run", tmp_path / "ckpt"
    env = _fake_slurm(tmp_path) | {
        "UNBROKEN_BIN": UNBROKEN, "UNBROKEN_NPROC_PER_NODE": "1", "UNBROKEN_MASTER_PORT": str(free_port()),
        "UNBROKEN_RUN_DIR": str(run_dir), "UNBROKEN_SAVE_DIR": str(save_dir),
        "UNBROKEN_RUN_FLAGS": "--persist-every-steps 2"}
    env.pop("UNBROKEN_JOB_SECRET", None)
    result = _run(["bash", str(SBATCH), str(EXAMPLE), "--steps", "4", "--optimizer", "plain", "--log-every", "1"],
                  env, timeout_s=100)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    (srun_line,) = [line for line in (tmp_path / "slurm.log").read_text().splitlines() if not line.startswith("scontrol")]
    assert srun_line.startswith("--nodes=1 --ntasks=1 --ntasks-per-node=1 bash -c")
    assert "--nnodes 1 --nproc-per-node 1 --master-addr 127.0.0.1" in srun_line
    (finished,) = events(run_dir, "job_finished")
    assert finished["exit_code"] == 0
    config = json.loads((run_dir / "config.node0.json").read_text())
    assert (config["nnodes"], config["node_rank"], config["nproc_per_node"]) == (1, 0, 1)
    assert config["job_id"] == "slurm-4242" and config["secret"] == "<redacted>"  # made up by the script
    assert "[rank 0] step 3" in output
    assert (save_dir / "step_00000004" / "MANIFEST.json").is_file()  # --persist-every-steps 2 reached


def test_sbatch_script_outside_slurm_is_a_usage_error(tmp_path):
    env = {k: "" for k in ("SLURM_JOB_ID", "SLURM_JOB_NUM_NODES")}
    result = _run(["bash", str(SBATCH), str(EXAMPLE)], env, timeout_s=30)
    assert result.returncode == 2
    assert "not inside a Slurm allocation" in result.stderr


@pytest.mark.slow  # the sbatch run above is the default run's real job
@pytest.mark.timeout(120)
def test_entrypoint_turns_a_fatal_job_into_exit_97(tmp_path):
    """EXIT_FATAL reaches the cluster manager as 97, so that JobSet (FailJobSet) and Slurm (no
    requeue) do not restart what cannot succeed."""
    result = _run(["bash", str(ENTRYPOINT), UNBROKEN, "run", "--nproc-per-node", "2", "--run-dir",
                   str(tmp_path / "run"), str(FATAL_SCRIPT), "exit"], {}, timeout_s=100)
    assert result.returncode == EXIT_FATAL, (result.stdout + result.stderr)[-3000:]
    assert "exited with EXIT_FATAL" in result.stderr  # the log still shows unbroken's own reason


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_entrypoint_stops_a_job_cleanly_on_sigterm(tmp_path):
    """SIGTERM (pod deletion, scancel) -> passed on to `unbroken run` as SIGTERM: it dumps its
    newest step to --save, stops its workers and exits 143; the autouse fixture checks that no
    process and no /dev/shm file is left."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(["bash", str(ENTRYPOINT), UNBROKEN, "run", "--nproc-per-node", "1", "--run-dir",
                             str(run_dir), "--save", str(tmp_path / "ckpt"), str(EXAMPLE), "--steps", "1000",
                             "--optimizer", "plain", "--log-every", "1", "--step-sleep-s", "0.05"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        for line in proc.stdout:
            if "[rank 0] step 2:" in line:
                break
        else:
            raise AssertionError("the job never reached step 2")
        proc.send_signal(signal.SIGTERM)  # only the entrypoint, as the kubelet and srun do
        start = time.monotonic()
        rest, _ = proc.communicate(timeout=60)
        stopped_s = time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 143, rest[-3000:]
    assert "terminated (SIGTERM) on node 0" in rest and "was dumped to --save" in rest
    assert events(run_dir, "dump_committed")
    assert stopped_s < 30, f"stopping took {stopped_s:.1f} s, more than the pods' grace period allows"
    assert "[rank 0] step 999:" not in rest


# getent as the entrypoint uses it: `getent hosts NAME`. The controller's name answers with an
# earlier pod's address for the first FAKE_STALE_ANSWERS calls, then with this pod's.
FAKE_GETENT = """#!/usr/bin/env bash
[ "$1" = hosts ] || exit 2
count=$(( $(cat "$FAKE_GETENT_COUNT" 2>/dev/null || echo 0) + 1 ))
echo "$count" > "$FAKE_GETENT_COUNT"
if [ "$2" = "$(hostname)" ]; then echo "192.0.2.20 $2"; exit 0; fi
[ "$2" = job-controller ] || exit 2
if [ "$count" -le "$FAKE_STALE_ANSWERS" ]; then echo "192.0.2.10 $2"; else echo "192.0.2.20 $2"; fi
"""


@pytest.mark.parametrize("node_rank, stale_answers, expect_rc", [
    ("1", 100, 0),  # another node only needs the name to resolve
    ("0", 100, 1),  # node 0 waits for its own address: a record of an earlier pod is not enough
    ("0", 2, 0),    # ... and goes on once the record names it
])
def test_entrypoint_waits_for_the_controller_name(tmp_path, node_rank, stale_answers, expect_rc):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "getent").write_text(FAKE_GETENT)
    (bin_dir / "getent").chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_GETENT_COUNT": str(tmp_path / "count"),
           "FAKE_STALE_ANSWERS": str(stale_answers), "UNBROKEN_WAIT_FOR_HOST": "job-controller",
           "UNBROKEN_WAIT_FOR_HOST_S": "3", "UNBROKEN_NODE_RANK": node_rank}
    result = _run(["bash", str(ENTRYPOINT), "true"], env, timeout_s=30)
    assert result.returncode == expect_rc, result.stderr
    if expect_rc:
        assert "did not resolve to the address of this pod (192.0.2.20) within 3 s" in result.stderr


@pytest.mark.parametrize("flags, no_kill", [("--recover-strategy retry,elastic,exit --elastic-mode fast", True),
                                             ("--recover-strategy retry,exit", False)])
def test_with_rung_elastic_srun_keeps_the_step_when_a_node_fails(tmp_path, flags, no_kill):
    """srun kills a job step when one of its nodes fails unless --no-kill: rung elastic needs the survivors."""
    env = _fake_slurm(tmp_path) | {"UNBROKEN_RUN_FLAGS": flags, "UNBROKEN_BIN": "true"}
    (tmp_path / "bin" / "srun").write_text('#!/usr/bin/env bash\necho "$*" >> "$FAKE_SLURM_LOG"\n')
    result = _run(["bash", str(SBATCH), str(EXAMPLE)], env, timeout_s=30)
    assert result.returncode == 0, result.stderr
    (srun_line,) = [line for line in (tmp_path / "slurm.log").read_text().splitlines()
                    if not line.startswith("scontrol")]
    assert ("--no-kill" in srun_line.split()) == no_kill
    assert flags in srun_line
