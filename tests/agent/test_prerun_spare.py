"""The agent's side of a pre-run spare (agent/prerun.py): its environment, the decision at a take,
and the fallback to warm spares. The spare is a tiny Python child speaking the same pipes (no
torch, no job): fast."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from unbroken.agent import prerun
from unbroken.agent.agent import Agent
from unbroken.agent.spares import Spares
from unbroken.config import LaunchConfig
from unbroken.protocol import messages as m
from unbroken.worker_config import ENV_GEN, ENV_PRERUN

READY_CHILD = """
import json, os, sys
print("building the model", flush=True)
fd = int(os.environ["UNBROKEN_PRERUN"])
os.write(fd, b'{"where": "job.steps()", "pid": 1}\\n'); os.close(fd)
order = json.loads(sys.stdin.readline())
print("assigned rank", order["env"]["RANK"], flush=True)
"""
FAILING_CHILD = """
import os
print("reading the rank early", flush=True)
raise KeyError("RANK")
"""
GIVEN = {"WORLD_SIZE": "4", "UNBROKEN_JOB_ID": "j1"}


def _child(code: str) -> prerun.PrerunSpare:
    read_fd, write_fd = os.pipe()
    popen = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, **{ENV_PRERUN: str(write_fd)}),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True, pass_fds=(write_fd,))
    os.close(write_fd)
    os.set_blocking(read_fd, False)
    return prerun.PrerunSpare(popen, read_fd, dict(GIVEN), ["train.py", "--steps", "3"])


def _poll_until(spare: prerun.PrerunSpare, state: str, timeout_s: float = 20) -> list:
    got, deadline = [], time.monotonic() + timeout_s
    while spare.state != state:
        assert time.monotonic() < deadline, f"spare never {state} (state {spare.state})"
        got += spare.poll()
        time.sleep(0.02)
    return got


def test_the_prerun_environment_has_no_rank_and_no_attempt():
    env = {"RANK": "2", "LOCAL_RANK": "2", "GROUP_RANK": "0", "ROLE_RANK": "2", "WORLD_SIZE": "4",
           "TORCHELASTIC_RESTART_COUNT": "1", ENV_GEN: "3", "MASTER_PORT": "5", "OMP_NUM_THREADS": "1"}
    assert prerun.prerun_env(env) == {"WORLD_SIZE": "4", "OMP_NUM_THREADS": "1"}


def test_an_order_must_run_what_the_spare_ran():
    argv = ["train.py", "--steps", "3"]
    order_env = dict(GIVEN, RANK="2", TORCHELASTIC_RESTART_COUNT="1")  # rank and attempt: the order's
    assert prerun.order_mismatch(GIVEN, argv, order_env, argv) == ""
    assert "argv differs" in prerun.order_mismatch(GIVEN, argv, order_env, ["train.py", "--steps", "4"])
    assert prerun.order_mismatch(GIVEN, argv, dict(order_env, WORLD_SIZE="8"), argv) == \
        "environment differs in WORLD_SIZE"


@pytest.mark.parametrize("state,mismatch,decision", [
    ("ready", "", "use"),
    ("starting", "", "cold"),  # still running its script: the rank starts fresh, the spare stays
    ("exited", "", "fallback"),
    ("ready", "argv differs", "fallback"),
])
def test_take_decision(state, mismatch, decision):
    assert prerun.take_decision(state, mismatch) == decision


@pytest.mark.timeout(30)
def test_a_ready_spare_reports_where_and_takes_its_order():
    spare = _child(READY_CHILD)
    try:
        (event,) = _poll_until(spare, "ready")
        assert event[0] == "spare_ready" and event[1]["where"] == "job.steps()" and event[1]["pid"] == spare.popen.pid
        shown: list[str] = []
        env = dict(GIVEN, RANK="2")
        assert spare.take(env, ["train.py", "--steps", "3"], shown.append) == "use"
        assert spare.popen.wait(10) == 0
        spare.reader.join(5)
        assert shown == ["assigned rank 2"]  # after the order: the rank's output
        assert list(spare.tail) == ["building the model"]  # before it: kept for prerun_failed only
        assert spare.state == "taken" and spare.failure is None
    finally:
        spare.drop()


@pytest.mark.timeout(30)
def test_a_spare_that_exits_before_its_order_is_reported_failed():
    spare = _child(FAILING_CHILD)
    try:
        (event,) = _poll_until(spare, "exited")
        name, fields = event
        assert name == "prerun_failed" and fields["exit_code"] == 1 and fields["where"] == ""
        assert "reading the rank early" in fields["last_lines"] and any("KeyError" in x for x in fields["last_lines"])
        assert spare.poll() == []  # reported once
    finally:
        spare.drop()


@pytest.mark.timeout(30)
def test_a_ready_spare_for_another_argv_is_dropped():
    spare = _child(READY_CHILD)
    _poll_until(spare, "ready")
    assert spare.take(dict(GIVEN, RANK="2"), ["other.py"], lambda line: None) == "fallback"
    assert "argv differs" in spare.failure["reason"]
    spare.drop()
    assert spare.popen.poll() is not None


class _Conn:
    def __init__(self) -> None:
        self.sent: list[m.Message] = []

    def send(self, msg: m.Message) -> None:
        self.sent.append(msg)


@pytest.mark.timeout(30)
def test_the_node_falls_back_to_warm_spares_when_its_prerun_spare_dies(tmp_path: Path):
    sent: list[m.Message] = []
    spares = Spares(LaunchConfig(script="train.py", nproc_per_node=4, prerun_spares=True, run_dir=tmp_path),
                    base_env=lambda: None, send=sent.append)
    started: list[bool] = []
    spares.start = lambda: started.append(spares.prerun_allowed)  # type: ignore[method-assign]
    spares._prerun = spare = _child(FAILING_CHILD)
    deadline = time.monotonic() + 20
    while spares.kind == "prerun":
        assert time.monotonic() < deadline
        spares.tick()  # what the agent's command loop does every prerun.POLL_S
        time.sleep(0.02)
    (event,) = sent
    assert isinstance(event, m.AgentEvent) and event.name == "prerun_failed" and event.fields["exit_code"] == 1
    assert started == [False]  # a warm spare next, and for the rest of the job
    assert spare.popen.poll() is not None
    assert spares.wait_s() is None  # no pre-run spare left to look at


@pytest.mark.timeout(30)
def test_the_agent_gives_a_ready_prerun_spare_the_lost_rank(tmp_path: Path):
    from unbroken.agent.agent import WorkerProc

    agent = Agent(LaunchConfig(script="train.py", script_args=("--steps", "3"), nproc_per_node=4, prerun_spares=True,
                               run_dir=tmp_path), "127.0.0.1", 1)
    agent._conn = _Conn()
    agent._spares._prerun = spare = _child(READY_CHILD)
    _poll_until(spare, "ready")
    try:
        proc = agent._from_prerun(WorkerProc(2, 2, 0, None), dict(GIVEN, RANK="2"), ["train.py", "--steps", "3"])
        assert proc is not None and proc.popen is spare.popen and proc.reader is spare.reader
        assert proc.popen.wait(10) == 0
        proc.reader.join(5)
        assert list(proc.tail) == ["assigned rank 2"]  # its output is the rank's now
        spares = agent._spares
        assert spares.prerun_allowed and spares.kind == "none"  # the next pre-runs too,
        assert spares.wait_s() is not None  # after the restart delay
        assert not agent._conn.sent  # its spare_ready went out earlier, from the command loop
    finally:
        spare.drop()
