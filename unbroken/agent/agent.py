"""The agent: one per node. Spawns, watches and stops this node's worker processes.

It runs the controller's orders (start an attempt, stop it, kill one hung worker, shut
down) received over its control connection, in the thread that calls :meth:`Agent.run`.
A watcher thread notices a worker's exit within ``WATCH_INTERVAL_S`` and reports it
with the exit code or signal and the last lines of its output. One reader thread per
worker prefixes the worker's output lines with its rank.

Worker states (``WorkerProc.state``): running -> exited (on its own) | stopped (by us).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TextIO

from unbroken.agent.persister import Persister
from unbroken.agent.placement import Placement
from unbroken.checkpoint import shm_files
from unbroken.config import LaunchConfig, worker_env
from unbroken.errors import ConnectionClosed, ProtocolError
from unbroken.protocol import messages as m
from unbroken.protocol.wire import Connection, connect
from unbroken.names import REPLACING_RUNGS

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.05
TAIL_LINES = 20
PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass
class WorkerProc:
    rank: int
    local_rank: int
    attempt: int
    popen: subprocess.Popen
    tail: deque = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    reader: threading.Thread | None = None
    state: str = "running"


class Agent:
    def __init__(self, cfg: LaunchConfig, controller_host: str, controller_port: int,
                 output: TextIO | None = None) -> None:
        self.cfg = cfg
        self.node_rank = cfg.node_rank
        self.controller = f"{controller_host}:{controller_port}"
        self._controller_addr = (controller_host, controller_port)
        self._output = output
        self._out_lock = threading.Lock()
        self._lock = threading.Lock()
        self._procs: dict[int, WorkerProc] = {}
        self._conn: Connection | None = None
        self.standby = cfg.standby
        self._placement = Placement(cfg.node_rank, cfg.nproc_per_node, cfg.standby)
        self._spare: subprocess.Popen | None = None
        self._use_spare = bool(REPLACING_RUNGS & set(cfg.recover_strategy))
        ckpt = cfg.checkpoint
        self._persister = Persister(ckpt, cfg.job_id, cfg.world_size, self._running_ranks, self._report_persisted) \
            if ckpt.save_dir and ckpt.every_steps and ckpt.persist_every_steps and cfg.job_id else None
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch_loop, name="unbroken-agent-watch", daemon=True)

    def run(self, connect_timeout_s: float = 30.0) -> tuple[int, str]:
        """Serve the controller until it says shut down; return (exit code, reason)."""
        host, port = self._controller_addr
        self._conn = connect(host, port, self.cfg.secret.encode(), "agent",
                             {"node_rank": self.node_rank}, timeout_s=connect_timeout_s)
        self._conn.send(m.AgentRegister(node_rank=self.node_rank, nproc=self.cfg.nproc_per_node,
                                        host=socket.gethostname(), pid=os.getpid(), standby=self.standby))
        self._watcher.start()
        self._claim_shared_memory()
        if self._persister is not None:
            self._persister.start()
        if self.standby:
            self._start_spare()
        try:
            while True:
                try:
                    msg = self._conn.recv()
                except (ConnectionClosed, ProtocolError, OSError) as exc:
                    return 1, f"lost the controller at {self.controller}: {exc}"
                if isinstance(msg, m.StartWorkers):
                    self._start(msg)
                elif isinstance(msg, m.StopWorkers):
                    self._stop_all(msg.attempt)
                    self._send(m.WorkersStopped(node_rank=self.node_rank, attempt=msg.attempt))
                elif isinstance(msg, m.KillWorker):
                    self._kill(msg.rank, msg.pid)
                elif isinstance(msg, m.RestartWorker):
                    self._restart(msg)
                elif isinstance(msg, m.Shutdown):
                    return msg.exit_code, msg.reason
        finally:
            self._stop.set()
            self._drop_spare()
            self._stop_all(None)
            if self._persister is not None:
                self._persister.stop()  # its last report still goes out on the open connection
            self._release_shared_memory()
            self._conn.close()

    # -- the node's shared-memory snapshots -------------------------------------------------
    def _claim_shared_memory(self) -> None:
        """Own this job's snapshot files on the node; clear what crashed jobs left behind."""
        shm = self.cfg.checkpoint.shm_dir
        if not self.cfg.job_id or not os.path.isdir(shm):
            return
        for job in shm_files.sweep_stale(shm):
            log.info("agent %d: removed the shared-memory snapshots of dead job %s", self.node_rank, job)
        shm_files.claim_job(shm, self.cfg.job_id, os.getpid())

    def _release_shared_memory(self) -> None:
        shm = self.cfg.checkpoint.shm_dir
        if self.cfg.job_id and os.path.isdir(shm):
            shm_files.remove_job(shm, self.cfg.job_id)

    def _report_persisted(self, step: int, ranks: list[int], seconds: float, error: str) -> None:
        self._send(m.Persisted(step=step, ranks=ranks, seconds=seconds, error=error))

    def _running_ranks(self) -> list[int]:
        with self._lock:
            return sorted(r for r, p in self._procs.items() if p.state == "running")

    # -- workers -------------------------------------------------------------------------
    def _start(self, msg: m.StartWorkers) -> None:
        for rank in self._placement.start(msg):
            self._spawn(rank, msg.attempt, gen=0)
        self._start_spare()

    def _restart(self, msg: m.RestartWorker) -> None:
        """Start one worker again (in-flight recovery); the old process is already dead."""
        with self._lock:
            old = self._procs.get(msg.rank)
        if old is not None and old.popen.poll() is None:
            _signal_group(old.popen, signal.SIGKILL)
            old.popen.wait()
        self._placement.restart(msg)
        self._spawn(msg.rank, msg.attempt, gen=msg.gen)

    def _spawn(self, rank: int, attempt: int, gen: int) -> None:
        local_rank = self._placement.local_rank(rank)
        host, port = self._placement.store_addr
        env = dict(os.environ)
        env.update(worker_env(self.cfg, rank=rank, local_rank=local_rank, attempt=attempt,
                              controller=self.controller, store_host=host, store_port=port, gen=gen,
                              world_size=self._placement.world_size))
        argv = [self.cfg.script, *self.cfg.script_args]
        popen = self._take_spare(env, argv) if gen > 0 else None
        if popen is None:
            popen = subprocess.Popen([sys.executable, "-u", *argv], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        proc = WorkerProc(rank, local_rank, attempt, popen)
        proc.reader = threading.Thread(target=self._read_output, args=(proc,),
                                       name=f"unbroken-out-r{rank}", daemon=True)
        proc.reader.start()
        with self._lock:
            self._procs[rank] = proc
        self._send(m.WorkerStarted(rank=rank, pid=popen.pid, attempt=attempt))

    # -- the warm spare ----------------------------------------------------------------------
    def _start_spare(self) -> None:
        """Pre-start a process that imports torch, to replace a lost rank without that wait."""
        if not self._use_spare or self._spare is not None:
            return
        env = dict(os.environ, OMP_NUM_THREADS=str(self.cfg.omp_num_threads), PYTHONUNBUFFERED="1")
        self._spare = subprocess.Popen([sys.executable, "-u", "-m", "unbroken.agent.spare"], env=env,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       start_new_session=True, preexec_fn=_die_with_parent)

    def _take_spare(self, env: dict[str, str], argv: list[str]) -> subprocess.Popen | None:
        spare, self._spare = self._spare, None
        if spare is None or spare.poll() is not None:
            return None
        try:
            assert spare.stdin is not None
            spare.stdin.write((json.dumps({"env": env, "argv": argv}) + "\n").encode())
            spare.stdin.close()
        except OSError:
            spare.kill()
            spare.wait()
            return None
        # The next spare starts from this (the command) thread: PR_SET_PDEATHSIG follows the
        # thread that forked, and this one lives as long as the agent.
        self._start_spare()
        return spare

    def _drop_spare(self) -> None:
        spare, self._spare = self._spare, None
        if spare is not None:
            _signal_group(spare, signal.SIGKILL)
            spare.wait()

    def _read_output(self, proc: WorkerProc) -> None:
        assert proc.popen.stdout is not None
        for raw in iter(proc.popen.stdout.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            proc.tail.append(line)
            if self._output is not None:
                with self._out_lock:
                    self._output.write(f"[rank {proc.rank}] {line}\n")
                    self._output.flush()
        proc.popen.stdout.close()

    def _watch_loop(self) -> None:
        while not self._stop.wait(WATCH_INTERVAL_S):
            with self._lock:
                exited = [p for p in self._procs.values() if p.state == "running" and p.popen.poll() is not None]
                for p in exited:
                    p.state = "exited"
            for p in exited:
                if p.reader is not None:
                    p.reader.join(timeout=0.5)  # the last lines matter for the root cause
                code = p.popen.returncode
                self._send(m.WorkerExited(rank=p.rank, pid=p.popen.pid, attempt=p.attempt,
                                          exit_code=code if code >= 0 else None,
                                          signal=-code if code < 0 else None, last_lines=list(p.tail)))

    def _kill(self, rank: int, pid: int) -> None:
        with self._lock:
            proc = self._procs.get(rank)
        if proc is not None and proc.popen.pid == pid and proc.popen.poll() is None:
            _signal_group(proc.popen, signal.SIGKILL)

    def _stop_all(self, attempt: int | None) -> None:
        """Stop every live worker (SIGTERM, then SIGKILL after the grace period) and reap it."""
        with self._lock:
            procs = [p for p in self._procs.values() if attempt is None or p.attempt <= attempt]
            for p in procs:
                if p.state == "running":
                    p.state = "stopped"
        for p in procs:
            if p.popen.poll() is None:
                _signal_group(p.popen, signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.stop_grace_s
        for p in procs:
            try:
                p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(p.popen, signal.SIGKILL)  # also reaps any child the worker left
            p.popen.wait()
            if p.reader is not None:
                p.reader.join(timeout=1.0)
        with self._lock:
            for p in procs:
                if self._procs.get(p.rank) is p:
                    del self._procs[p.rank]

    def _send(self, msg: m.Message) -> None:
        if self._conn is None:
            return
        try:
            self._conn.send(msg)
        except (OSError, ProtocolError) as exc:
            log.warning("agent %d: could not send %s: %s", self.node_rank, type(msg).__name__, exc)


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it if the agent dies, so no worker outlives its agent."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: the agent's own clean-up still stops workers
        pass


def _signal_group(popen: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
