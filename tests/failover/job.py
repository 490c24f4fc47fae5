"""A multi-node `unbroken run` job on loopback with ``--controller-store`` (controller failover):
one agent per node on 127.0.0.1, each with its own run dir and its own shared-memory dir (its
"node"), a standby agent where asked, and a real etcd. Every agent's output is read by a thread
and kept whole for the test's messages; :meth:`FailoverJob.close` kills whatever is left and
removes the shared-memory dirs."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
import uuid
from pathlib import Path

import psutil

from tests.conftest import EXAMPLE, REPO, free_port
from tests.integration.helpers import TRAIN_ARGS
from tests.netns.job import Agent as NetnsAgent

SECRET = "failover-job-secret-0123456789abcdefghij"  # strong enough (>= 32 characters, >= 10 distinct)


class Agent(NetnsAgent):
    """One `unbroken run` process on loopback; its output collected by a reader thread."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        super().__init__(None, argv, env)
        self.name = name

    def processes(self) -> list[psutil.Process]:
        """The agent and every process under it (its workers, their children)."""
        try:
            me = psutil.Process(self.popen.pid)
            return [me, *me.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def kill_all(self) -> list[int]:
        """SIGKILL of the agent and its workers at once (a lost node); their pids."""
        procs = self.processes()
        for p in procs:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        return [p.pid for p in procs]


class FailoverJob:
    """Nodes 0..nnodes-1 on loopback, a standby if asked, all with ``--controller-store``."""

    def __init__(self, tmp: Path, store: str, *, nnodes: int = 2, nproc: int = 1, steps: int = 12,
                 standby: bool = True, flags: list[str] = (), train_args: list[str] = (),
                 script: Path | None = None, store_for: dict[str, str] | None = None) -> None:
        self.tmp = tmp
        self.out = tmp / "weights.safetensors"
        self.port = free_port()
        self.job_id = f"failover-{uuid.uuid4().hex[:8]}"
        self.shm_root = Path("/dev/shm") / f"unbroken-test-{self.job_id}"
        script = [str(script)] if script is not None else [
            str(EXAMPLE), "--steps", str(steps), "--out", str(self.out), *TRAIN_ARGS, *train_args]
        common = ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
                  "--master-port", str(self.port), "--rdzv-id", self.job_id, *flags]
        stores = store_for or {}  # an agent's own --controller-store (the etcd members it reaches)

        def store_of(name: str) -> list[str]:
            return ["--controller-store", stores.get(name, store)]

        self.agents: list[Agent] = []
        for node in range(nnodes):
            self.agents.append(self._agent(f"node{node}", ["--node-rank", str(node), *common, *store_of(f"node{node}")],
                                           script))
            if node == 0:
                time.sleep(0.5)  # node 0 leads first (the others stand by until a leader is there)
        self.standby = self._agent("standby", ["--standby", *common, *store_of("standby")], script) \
            if standby else None

    def _agent(self, name: str, flags: list[str], script: list[str]) -> Agent:
        shm = self.shm_root / name
        shm.mkdir(parents=True)
        argv = [sys.executable, "-m", "unbroken.cli.main", "run", *flags, "--run-dir", str(self.tmp / name),
                "--shm-dir", str(shm), *script]
        env = dict(os.environ, UNBROKEN_JOB_SECRET=SECRET)
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        return Agent(name, argv, env)

    @property
    def all_agents(self) -> list[Agent]:
        return self.agents + ([self.standby] if self.standby else [])

    def run_dir(self, name: str) -> Path:
        return self.tmp / name

    def wait_for(self, predicate, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s} s waiting for {what}\n{self.outputs()}")
            time.sleep(0.05)

    def printed(self, mark: str) -> bool:
        return any(mark in line for a in self.all_agents for line in a.lines)

    def finish(self, timeout_s: float, agents: list[Agent]) -> list[int | None]:
        deadline = time.monotonic() + timeout_s
        return [a.wait(max(0.1, deadline - time.monotonic())) for a in agents]

    def outputs(self) -> str:
        return "\n".join(f"--- {a.name}:\n{a.output()}" for a in self.all_agents)

    def close(self) -> None:
        """Kill whatever is left (agents, workers) and remove the shared-memory dirs."""
        for a in self.all_agents:
            if a.popen.poll() is None:
                a.kill_all()
            a.wait(10)
        shutil.rmtree(self.shm_root, ignore_errors=True)
