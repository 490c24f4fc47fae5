"""A multi-node `unbroken run` job across netns hosts: one agent per host, node 0 hosts the
controller, a standby agent on a host of its own where asked. Every agent's output is read by a
thread (so none blocks on a full pipe) and kept whole for the test's messages."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.conftest import EXAMPLE, REPO
from tests.integration.helpers import TRAIN_ARGS
from tests.netns.hosts import Host, Hosts

SECRET = "netns-job-secret-0123456789abcdefghij"  # strong enough (>= 32 characters, >= 10 distinct)
PORT = 29400  # every host is a fresh namespace: any port is free there


class Agent:
    """One `unbroken run` process on a host; its output collected by a reader thread."""

    def __init__(self, host: Host | None, argv: list[str], env: dict[str, str]) -> None:
        self.host = host  # None: on this machine's own network (tests/failover/job.py)
        self.lines: list[str] = []
        self.popen = subprocess.Popen(host.argv(argv) if host else argv, env=env, cwd=REPO, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self.lines.append(line)

    def wait(self, timeout_s: float) -> int | None:
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def output(self, tail: int = 4000) -> str:
        return "".join(self.lines)[-tail:]


class NetnsJob:
    """Nodes 0..nnodes-1 on hosts 0..nnodes-1, a standby (if any) on the next host; every agent runs
    ``script`` (train_gpt.py unless told) with TRAIN_ARGS, then ``train_args``."""

    def __init__(self, hosts: Hosts, tmp: Path, *, nnodes: int = 2, nproc: int = 2, steps: int = 12,
                 standby: bool = False, flags: list[str] = (), train_args: list[str] = (),
                 standby_flags: list[str] = (), script: Path = EXAMPLE) -> None:
        self.hosts, self.tmp, self.nnodes = hosts, tmp, nnodes
        self.out = tmp / "weights.safetensors"
        self.run_dir = tmp / "node0"  # the controller's run dir: its event log
        script = [str(script), "--steps", str(steps), "--out", str(self.out), *TRAIN_ARGS, *train_args]
        master = hosts[0].addr
        self.agents: list[Agent] = []
        self._argv: list[list[str]] = []
        for node in range(nnodes):
            h = hosts[node]
            argv = [sys.executable, "-m", "unbroken.cli.main", "run", "--nnodes", str(nnodes), "--node-rank",
                    str(node), "--nproc-per-node", str(nproc), "--master-addr", master, "--master-port", str(PORT),
                    "--run-dir", str(tmp / f"node{node}"), "--shm-dir", str(h.shm_dir), *flags, *script]
            self._argv.append(argv)
            self.agents.append(Agent(h, argv, self._env(h)))
            if node == 0:
                time.sleep(0.5)  # the controller listens first (the others retry anyway)
        self.standby: Agent | None = None
        if standby:
            h = hosts[nnodes]
            argv = [sys.executable, "-m", "unbroken.cli.main", "run", "--standby", "--nproc-per-node", str(nproc),
                    "--master-addr", master, "--master-port", str(PORT), "--run-dir", str(tmp / "standby"),
                    "--shm-dir", str(h.shm_dir), *standby_flags, *flags_for_standby(flags), *script]
            self.standby = Agent(h, argv, self._env(h))

    def restart_agent(self, node: int) -> Agent:
        """Start node ``node``'s agent again, on its host, as it was started (a node that comes back, its
        memory empty: Host.kill removed it)."""
        h = self.hosts[node]
        h.shm_dir.mkdir(mode=0o700, exist_ok=True)
        self.agents[node] = Agent(h, self._argv[node], self._env(h))
        return self.agents[node]

    @staticmethod
    def _env(h: Host) -> dict[str, str]:
        env = dict(os.environ, UNBROKEN_JOB_SECRET=SECRET, **h.env())
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        return env

    @property
    def all_agents(self) -> list[Agent]:
        return self.agents + ([self.standby] if self.standby else [])

    def wait_for(self, predicate, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s} s waiting for {what}\n{self.outputs()}")
            if self.agents[0].popen.poll() is not None:
                raise AssertionError(f"the controller's agent exited while waiting for {what}\n{self.outputs()}")
            time.sleep(0.05)

    def wait_step(self, rank: int, step: int, timeout_s: float = 120) -> None:
        """Until rank ``rank`` printed its step ``step`` (the example's `[rank r] step s:` lines)."""
        mark = f"[rank {rank}] step {step}:"
        self.wait_for(lambda: any(mark in line for a in self.agents for line in a.lines), timeout_s,
                      f"rank {rank} at step {step}")

    def finish(self, timeout_s: float, agents: list[Agent] | None = None) -> list[int | None]:
        """Exit codes of ``agents`` (default all), each waited for up to the shared deadline."""
        deadline = time.monotonic() + timeout_s
        return [a.wait(max(0.1, deadline - time.monotonic())) for a in (agents or self.all_agents)]

    def outputs(self) -> str:
        return "\n".join(f"--- {a.host.ns}:\n{a.output()}" for a in self.all_agents)


def flags_for_standby(flags: list[str]) -> list[str]:
    """The node flags a standby agent takes too (checkpointing, strategies); not the fault plan."""
    out, skip = [], False
    for i, f in enumerate(flags):
        if skip:
            skip = False
            continue
        if f in ("--inject", "--nnodes", "--node-rank"):
            skip = True
            continue
        out.append(f)
    return out
