"""The agent: one per node, the node's process manager. Spawns, watches and stops this node's
worker processes; its spare process (warm or pre-run) is held by a :class:`~unbroken.agent.spares.Spares`.

It runs the controller's orders (start an attempt, stop it, kill one hung worker, shut down) received
over its control connection, in the thread that calls :meth:`Agent.run`. A watcher thread notices a
worker's exit within ``WATCH_INTERVAL_S`` and reports it with the exit code or signal and the last
lines of its output. One reader thread per worker prefixes the worker's output lines with its rank.
On the first SIGTERM (:meth:`Agent.request_stop`) a thread asks the controller to dump and stop the
job, and stops this node on its own if no shutdown order comes in time.

Worker states (``WorkerProc.state``): running -> exited (on its own) | stopped (by us).
"""

from __future__ import annotations

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
from typing import Protocol, TextIO

from unbroken.agent.fence import ControllerWatch
from unbroken.agent.forks import ForkedRank, Zygote
from unbroken.agent.placement import Placement
from unbroken.agent.processes import die_with_parent, process_state, signal_group
from unbroken.agent.relay import NodeRelay
from unbroken.agent.spares import Spares
from unbroken.checkpoint import own_state, shm_files
from unbroken.checkpoint.launch_dirs import run_id
from unbroken.config import LaunchConfig, worker_env
from unbroken.errors import ConnectionClosed, ProtocolError
from unbroken.protocol import messages as m
from unbroken.protocol.wire import Connection, connect, local_address

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.05
STATUS_EVERY = 2  # watch rounds between looks at the workers' process states (stopped, zombie): 0.1 s
TAIL_LINES = 20
#: After SIGTERM, how much longer than --sigterm-dump-timeout-s an agent waits for the
#: controller's shutdown order before it stops its node on its own (the controller is gone or stuck).
SIGTERM_MARGIN_S = 5.0
#: With --controller-store: how long an agent whose controller is gone waits for the next leader.
FOLLOW_TIMEOUT_S = 60.0


class LeaderSource(Protocol):
    """Where the job's leading controller listens (agent/failover.py reads it from etcd)."""

    def find(self, *, after_term: int, timeout_s: float) -> tuple[str, int, int]:
        """(host, port, term) of a leader whose term is above ``after_term``; TimeoutError if none comes."""


@dataclass
class WorkerProc:
    rank: int
    local_rank: int
    attempt: int
    popen: subprocess.Popen | ForkedRank | None  # None only while a pre-run spare is being taken for it
    tail: deque = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    reader: threading.Thread | None = None
    state: str = "running"
    process: str = "running"  # the OS's view, last reported: running | stopped | zombie


class Agent:
    def __init__(self, cfg: LaunchConfig, controller_host: str, controller_port: int,
                 output: TextIO | None = None, leader: LeaderSource | None = None,
                 zygote: Zygote | None = None) -> None:
        self.cfg = cfg
        self.node_rank = cfg.node_rank
        self.controller = f"{controller_host}:{controller_port}"
        self._controller_addr = (controller_host, controller_port)
        self._output = output
        self._out_lock = threading.Lock()
        self._lock = threading.Lock()
        self._procs: dict[int, WorkerProc] = {}
        self._conn: Connection | None = None
        self._leader = leader  # where the leading controller is (--controller-store): followed when lost
        self._term = 0  # the term of the leader this agent serves
        self._lost = ""  # why the last controller connection ended
        self._warm_restart = False  # the next attempt follows a takeover: start it from the warm spare
        self.standby = cfg.standby
        self._placement = Placement(cfg.node_rank, cfg.nproc_per_node, cfg.standby)
        # The node's ranks are forked from the zygote (agent/forks.py) while it can; this agent closes it.
        self._zygote = zygote
        self._spares = Spares(cfg, self._prerun_env, self._send,
                              zygote_ready=lambda: self._zygote is not None and not self._zygote.unusable)
        ckpt = cfg.checkpoint
        self._persister = None
        if ckpt.save_dir and ckpt.every_steps and ckpt.persist_every_steps and cfg.job_id:
            # Imported here: the persister reads snapshots with torch; an agent without one never imports torch.
            from unbroken.agent.persister import Persister

            self._persister = Persister(ckpt, cfg.job_id, self._job_world_size, self._running_ranks,
                                        self._report_persisted, run_id=run_id(cfg.secret, cfg.job_id))
        self._peer = None  # the node's peer copies (agent/peer_memory.py), under a memory tier: built in run()
        self._relay: NodeRelay | None = None  # built in run() under the setting node_reports
        self._stop = threading.Event()
        # Heartbeats to the controller; a silent controller (link cut, controller frozen) fences this node.
        self._watch = ControllerWatch(cfg.node_rank, cfg.node_timeout_s, self._send, self._fence)
        self._fenced = ""  # why this node stopped its workers on its own ("": it did not)
        self._watcher = threading.Thread(target=self._watch_loop, name="unbroken-agent-watch", daemon=True)

    def run(self, connect_timeout_s: float = 30.0) -> tuple[int, str]:
        """Serve the controller until it says shut down; return (exit code, reason). With a leader
        source (--controller-store), a lost controller is followed to the next leader instead."""
        self._peer = self._build_peer_memory()
        # The ranks start from the zygote: join once its imports are done, not before. (Waiting for it
        # later, in the command thread, would leave the controller's messages unread: this node fences.)
        if self._zygote is not None and not self._zygote.wait_ready():
            self._zygote.close()
        worker = self.cfg.worker
        if worker.node_reports or worker.node_summaries:  # per-node aggregation of step reports (agent/relay.py)
            # Under summaries the relay also serves its group's other agents (agent/summary_tree.py): it listens
            # where they reach this node, and its port goes to the controller's address book with the hello.
            host = local_address(*self._controller_addr) if worker.node_summaries else "127.0.0.1"
            self._relay = NodeRelay(self.cfg.secret.encode(), self._send, host=host, summaries=worker.node_summaries)
            self._relay.start()
        self._open(*self._first_controller(connect_timeout_s), timeout_s=connect_timeout_s)
        self._watcher.start()
        self._claim_shared_memory()
        if self._persister is not None:
            self._persister.start()
        if self._peer is not None:
            self._peer.start()
        if self.standby:
            self._spares.start()
        try:
            while True:
                done = self._serve()
                if done is not None:
                    return done
                lost = self._fenced or f"lost the controller at {self.controller}: {self._lost}"
                if self._leader is None or not self._follow(lost):
                    return 1, lost
        finally:
            self._stop.set()
            self._watch.stop()
            self._spares.drop()
            self._stop_all(None)
            if self._zygote is not None:
                self._zygote.close()
            if self._persister is not None:
                self._persister.stop()  # its last report still goes out on the open connection
            if self._peer is not None:
                self._peer.stop()
            self._release_shared_memory()
            if self._relay is not None:
                self._relay.close()
            self._conn.close()

    def _serve(self) -> tuple[int, str] | None:
        """The command loop on the current connection: (exit code, reason) on a shutdown order, None
        when the connection is lost (why: ``self._lost``)."""
        assert self._conn is not None
        while True:
            try:
                msg = self._conn.recv(timeout_s=self._spares.wait_s())
            except TimeoutError:  # (an OSError) a spare is due to start, or to be looked at
                self._spares.tick()
                continue
            except (ConnectionClosed, ProtocolError, OSError) as exc:
                self._lost = str(exc)
                return None
            self._watch.heard()
            if isinstance(msg, m.StartRanks):
                self._start(msg)
            elif isinstance(msg, m.StopRanks):
                self._stop_all(msg.attempt)
                self._send(m.RanksStopped(node_rank=self.node_rank, attempt=msg.attempt))
            elif isinstance(msg, m.KillRank):
                self._kill(msg.rank, msg.pid)
            elif isinstance(msg, m.RestartRank):
                self._restart(msg)
            elif isinstance(msg, m.PeerAgents):
                self._peer_agents(msg)
            elif isinstance(msg, m.SpareImports):
                self._spares.set_imports(msg.modules)
                if self._zygote is not None:
                    self._zygote.pre_import(msg.modules)
            elif isinstance(msg, m.FlushReports):
                if self._relay is not None:
                    self._relay.flush()
            elif isinstance(msg, m.Shutdown):
                return msg.exit_code, msg.reason

    # -- the controller's address, and following a new leader (agent/failover.py) --------------
    def _first_controller(self, timeout_s: float) -> tuple[str, int]:
        if self._leader is None:
            return self._controller_addr
        try:
            host, port, self._term = self._leader.find(after_term=0, timeout_s=timeout_s)
        except TimeoutError as exc:
            raise ConnectionClosed(f"agent {self.node_rank}: {exc}; is node 0's agent started with the same "
                                   "--controller-store and --rdzv-id, and does etcd answer there?") from None
        return host, port

    def _open(self, host: str, port: int, timeout_s: float) -> None:
        """Connect to the controller at host:port, register, and watch it (heartbeats, fencing)."""
        ident: dict = {"node_rank": self.node_rank}
        if self._peer is not None:  # its port reaches the controller's address book (PeerAgents)
            ident["peer_port"] = self._peer.port
        if self._relay is not None and self._relay.tree is not None:  # the summary tree's (agent/summary_tree.py)
            ident["relay_port"] = self._relay.port
        conn = connect(host, port, self.cfg.secret.encode(), "agent", ident, timeout_s=timeout_s)
        self._conn, self._controller_addr, self.controller = conn, (host, port), f"{host}:{port}"
        self._conn.send(m.AgentRegister(node_rank=self.node_rank, nproc=self.cfg.nproc_per_node,
                                        host=socket.gethostname(), pid=os.getpid(), standby=self.standby))
        self._watch.stop()
        # Heartbeats to the controller; a silent controller (link cut, controller frozen) fences this node.
        self._watch = ControllerWatch(self.cfg.node_rank, self.cfg.node_timeout_s, self._send, self._fence)
        self._watch.start()

    def _follow(self, lost: str) -> bool:
        """The controller is gone (--controller-store): stop this node's workers at once (their attempt
        ends with the controller: the next leader restarts the job from the memory tier, see
        controller/takeover.py), then connect to the next leader named in etcd. False if none came."""
        log.warning("agent %d: %s; stopping this node's workers and following the next controller",
                    self.node_rank, lost)
        self._watch.stop()
        self._stop_all(None, grace_s=0.0)
        self._fenced, self._warm_restart = "", True
        deadline = time.monotonic() + FOLLOW_TIMEOUT_S
        while (left_s := deadline - time.monotonic()) > 0:
            try:
                host, port, term = self._leader.find(after_term=self._term, timeout_s=left_s)
            except TimeoutError as exc:
                self._lost = f"{lost}; {exc}"
                return False
            self._term = term
            try:
                self._conn.close()
                self._open(host, port, timeout_s=min(left_s, 10.0))
                log.warning("agent %d: following the controller at %s:%d (term %d)", self.node_rank, host, port, term)
                return True
            except (ConnectionClosed, ProtocolError, OSError) as exc:  # gone already: wait for the next one
                log.warning("agent %d: the controller at %s:%d (term %d) did not answer: %s", self.node_rank,
                            host, port, term, exc)
        return False

    # -- SIGTERM ------------------------------------------------------------------------------
    def request_stop(self, signum: int) -> bool:
        """The first SIGTERM, called in the main thread by the CLI's signal handler: ask the
        controller to dump the job's newest committed step and stop it (controller/terminate.py);
        True when asked. False when this agent cannot ask (not serving yet, --sigterm-dump-timeout-s
        0, a spare hosting no rank): the caller then stops this node at once. Only starts a
        thread: the handler may have interrupted this agent's own send."""
        if self._conn is None or self._stop.is_set() or self.cfg.sigterm_dump_timeout_s <= 0:
            return False
        if self.standby and not self._running_ranks():
            return False
        threading.Thread(target=self._ask_to_stop, args=(signum,), name="unbroken-agent-sigterm", daemon=True).start()
        return True

    def _ask_to_stop(self, signum: int) -> None:
        sent = self._send(m.StopRequested(node_rank=self.node_rank, signal=signum))
        wait_s = self.cfg.sigterm_dump_timeout_s + SIGTERM_MARGIN_S if sent else 0.0
        if not self._stop.wait(wait_s):  # no shutdown order came: stop as on a second SIGTERM
            log.warning("agent %d: no shutdown order from the controller at %s within %.0f s of %s; stopping "
                        "this node's workers now", self.node_rank, self.controller, wait_s, signal.Signals(signum).name)
            os.kill(os.getpid(), signum)

    # -- fencing ---------------------------------------------------------------------------
    def _fence(self, silent_s: float) -> None:
        """The controller has been silent for ``silent_s`` (controller/liveness.py): kill this node's
        workers now (no grace: they belong to a generation the job may already have left), and end
        the command loop. The node does not rejoin: its agent exits."""
        self._fenced = (f"fenced: no message from the controller at {self.controller} for {silent_s:.1f} s "
                        f"(--node-timeout-s {self.cfg.node_timeout_s:g}: this node fences itself after "
                        f"{self._watch.fence_after_s:g} s); stopped its workers so that none trains on a "
                        "generation it no longer belongs to, and left the job")
        log.warning("agent %d: %s", self.node_rank, self._fenced)
        with self._lock:
            procs = [p for p in self._procs.values() if p.state == "running" and p.popen is not None]
            for p in procs:
                p.state = "stopped"
        for p in procs:
            signal_group(p.popen, signal.SIGKILL)
        self._conn.close()  # the command loop's recv ends: run() returns the reason above

    # -- the node's shared-memory snapshots -------------------------------------------------
    def _claim_shared_memory(self) -> None:
        """Own this job's snapshot files on the node; clear what crashed jobs left behind."""
        shm = self.cfg.checkpoint.shm_dir
        if not self.cfg.job_id or not os.path.isdir(shm):
            return
        for job in shm_files.sweep_stale(shm):
            log.info("agent %d: removed the shared-memory snapshots of dead job %s", self.node_rank, job)
        shm_files.claim_job(shm, self.cfg.job_id, os.getpid())

    def _own_state(self, rank: int) -> tuple[int, bytes] | None:
        """A rank's own state from the file its process left (checkpoint/own_state.py), which is removed."""
        shm = self.cfg.checkpoint.shm_dir
        if not self.cfg.job_id or not os.path.isdir(shm):
            return None
        return own_state.take(shm_files.own_state_path(shm, self.cfg.job_id, rank))

    def _release_shared_memory(self) -> None:
        shm = self.cfg.checkpoint.shm_dir
        if self.cfg.job_id and os.path.isdir(shm):
            shm_files.remove_job(shm, self.cfg.job_id)

    def _build_peer_memory(self):
        """The node's peer copies (agent/peer_memory.py) where it has a memory tier and they are on."""
        cfg, ckpt = self.cfg, self.cfg.checkpoint
        if not (ckpt.every_steps and ckpt.peer_memory and cfg.job_id and os.path.isdir(ckpt.shm_dir)
                and (cfg.nnodes > 1 or cfg.standby)):  # one node: no other memory to keep a copy in
            return None
        from unbroken.agent.peer_memory import PeerMemory  # (an agent without one never needs it)

        return PeerMemory(cfg.secret.encode(), ckpt.shm_dir, cfg.job_id, self.node_rank, self._running_ranks,
                          host=local_address(*self._controller_addr))

    def _peer_agents(self, msg: m.PeerAgents) -> None:
        if self._peer is not None:
            peers = {a: (h, p) for a, h, p in zip(msg.agents, msg.hosts, msg.ports)}
            self._peer.set_peers(peers, set(msg.hosting), me=msg.you)
        if self._relay is not None and self._relay.tree is not None and len(msg.relay_ports) == len(msg.agents):
            relays = {a: (h, p) for a, h, p in zip(msg.agents, msg.hosts, msg.relay_ports)}
            self._relay.tree.set_book(msg.you, relays, msg.hosting)

    def _fetch_peer_copies(self, ranks: list[int]) -> None:
        """Before a job restart's workers start: the ranks with no snapshot in this node's memory get
        the newest copy a peer node holds (their restore then says tier ``peer_memory``)."""
        for rank, got in self._peer.fetch_missing(ranks, timeout_s=self.cfg.worker.recovery_timeout_s).items():
            self._send(m.AgentEvent(name="peer_copy_fetched", fields={"rank": rank, **got}))

    def _fetch_replicas(self, sources: dict[int, tuple[int, int]]) -> None:
        """A scale-out took this node in: each of its ranks gets a surviving rank's snapshots, fetched from
        that rank's node (controller/elastic.py). One that cannot is started all the same, with nothing in
        memory: the controller then sees no common restore step and undoes the scale-out."""
        for rank, (agent, source) in sorted(sources.items()):
            got = None if self._peer is None else \
                self._peer.fetch_replica(rank, agent, source, timeout_s=self.cfg.worker.recovery_timeout_s)
            if got is None:
                why = "this node keeps no peer memory (--no-peer-memory)" if self._peer is None else \
                    f"agent {agent} sent no committed snapshot of rank {source}"
                log.warning("agent %d: rank %d: no replica snapshot fetched: %s", self.node_rank, rank, why)
                self._send(m.AgentEvent(name="replica_fetch_failed", fields={"rank": rank, "agent": agent,
                                                                             "from_rank": source, "reason": why}))
            else:
                self._send(m.AgentEvent(name="peer_copy_fetched", fields={"rank": rank, "from_rank": source, **got}))

    def _report_persisted(self, step: int, ranks: list[int], seconds: float, error: str) -> None:
        self._send(m.Persisted(step=step, ranks=ranks, seconds=seconds, error=error))

    def _job_world_size(self) -> int:
        """The job's world size, as the controller's orders say (a standby's own flags do not)."""
        return self._placement.world_size or self.cfg.world_size

    def _running_ranks(self) -> list[int]:
        with self._lock:
            return sorted(r for r, p in self._procs.items() if p.state == "running")

    # -- workers -------------------------------------------------------------------------
    def _start(self, msg: m.StartRanks) -> None:
        # After a takeover (--controller-store), the restart's workers come from this node's warm spare
        # where it has one (torch already imported): they are the recovery.
        warm, self._warm_restart = self._warm_restart, False
        ranks = self._placement.start(msg)
        self._fetch_replicas(self._placement.fetch_sources(msg, ranks))
        if msg.attempt > 0 and self._peer is not None:  # a job restart: ranks moved here from a lost node
            self._fetch_peer_copies(ranks)
        for rank in ranks:
            self._spawn(rank, msg.attempt, gen=0, warm=warm)
        self._spares.start()

    def _restart(self, msg: m.RestartRank) -> None:
        """Start one worker again (in-flight recovery); the old process is already dead."""
        with self._lock:
            old = self._procs.get(msg.rank)
        if old is not None and old.popen.poll() is None:
            signal_group(old.popen, signal.SIGKILL)
            old.popen.wait()
        self._placement.restart(msg)
        self._spawn(msg.rank, msg.attempt, gen=msg.gen)

    def _spawn(self, rank: int, attempt: int, gen: int, warm: bool = False) -> None:
        local_rank = self._placement.local_rank(rank)
        env = dict(os.environ, **self._worker_env(rank, local_rank, attempt, gen))
        argv = [self.cfg.script, *self.cfg.script_args]
        proc = self._from_prerun(WorkerProc(rank, local_rank, attempt, None), env, argv) if gen > 0 else None
        how = "prerun"  # how the rank started, for its rank_started event
        if proc is None:
            popen, how = (self._spares.take_warm(env, argv) if gen > 0 or warm else None), "spare"
            if popen is None and self._zygote is not None:
                popen, how = self._zygote.fork(env, argv), self._zygote.kind
                if popen is None:
                    self._spares.start()  # the zygote forks no more: a warm spare for the next replacement
            if popen is None:
                how, popen = "process", subprocess.Popen(
                    [sys.executable, "-u", *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent)
            proc = WorkerProc(rank, local_rank, attempt, popen)
            proc.reader = threading.Thread(target=self._read_output, args=(proc,), name=f"unbroken-out-r{rank}",
                                           daemon=True)
            proc.reader.start()
        popen = proc.popen
        with self._lock:
            self._procs[rank] = proc
        self._send(m.RankStarted(rank=rank, pid=popen.pid, attempt=attempt, how=how))

    def _worker_env(self, rank: int, local_rank: int, attempt: int, gen: int) -> dict[str, str]:
        host, port = self._placement.store_addr
        return worker_env(self.cfg, rank=rank, local_rank=local_rank, attempt=attempt, controller=self.controller,
                          store_host=host, store_port=port, gen=gen, world_size=self._placement.world_size,
                          store_prefix=self._placement.store_prefix,
                          relay=self._relay.address if self._relay is not None else "",
                          extra=self._placement.shape_env(rank))

    # -- the spare (agent/spares.py) --------------------------------------------------------
    def _prerun_env(self) -> dict[str, str] | None:
        """The worker environment a pre-run spare starts from; None before this node knows its job."""
        return self._worker_env(0, 0, 0, 0) if self._placement.world_size else None

    def _from_prerun(self, proc: WorkerProc, env: dict[str, str], argv: list[str]) -> WorkerProc | None:
        """``proc`` run by the pre-run spare if it can take the order; else None."""
        taken = self._spares.take_prerun(env, argv, lambda line: self._show_line(proc, line))
        if taken is None:
            return None
        proc.popen, proc.reader = taken
        return proc

    def _read_output(self, proc: WorkerProc) -> None:
        assert proc.popen.stdout is not None
        for raw in iter(proc.popen.stdout.readline, b""):
            self._show_line(proc, raw.decode("utf-8", "replace").rstrip("\n"))
        proc.popen.stdout.close()

    def _show_line(self, proc: WorkerProc, line: str) -> None:
        proc.tail.append(line)
        if self._output is not None:
            with self._out_lock:
                self._output.write(f"[rank {proc.rank}] {line}\n")
                self._output.flush()

    def _watch_loop(self) -> None:
        rounds = 0
        while not self._stop.wait(WATCH_INTERVAL_S):
            rounds += 1
            if rounds % STATUS_EVERY == 0:
                self._report_process_states()
            with self._lock:
                exited = [p for p in self._procs.values() if p.state == "running" and p.popen.poll() is not None]
                for p in exited:
                    p.state = "exited"
            if self._relay is not None:
                self._relay.flush_due()
            for p in exited:
                if p.reader is not None:
                    # The last lines matter for the root cause; a dead process's are in the pipe at once. No longer:
                    # its children (a loader's workers) may hold the pipe open, and a rank seen a zombie for
                    # 0.25 s is taken for hung (controller/watchdog.py) before its exit would be reported.
                    p.reader.join(timeout=0.1)
                if self._relay is not None:
                    self._relay.rank_gone(p.rank)  # its last step reports go before its exit
                code = p.popen.returncode
                own_step, own = self._own_state(p.rank) or (-1, b"")
                self._send(m.RankExited(rank=p.rank, pid=p.popen.pid, attempt=p.attempt,
                                          exit_code=code if code >= 0 else None,
                                          signal=-code if code < 0 else None, last_lines=list(p.tail),
                                          own_step=own_step, own_state=own))

    def _report_process_states(self) -> None:
        """Tell the controller when a running worker's process is stopped or a zombie (or runs
        again): the hang monitor blames such a rank first (controller/hangs.py)."""
        with self._lock:
            procs = [p for p in self._procs.values() if p.state == "running"]
        for p in procs:
            status = process_state(p.popen.pid)
            if status != p.process:
                p.process = status
                if self._relay is not None and status != "running":
                    self._relay.flush()  # its peers' places first: the hang rule weighs them (agent/held_reports.py)
                self._send(m.RankStatus(rank=p.rank, pid=p.popen.pid, attempt=p.attempt, status=status))

    def _kill(self, rank: int, pid: int) -> None:
        with self._lock:
            proc = self._procs.get(rank)
        if proc is not None and proc.popen.pid == pid and proc.popen.poll() is None:
            signal_group(proc.popen, signal.SIGKILL)

    def _stop_all(self, attempt: int | None, grace_s: float | None = None) -> None:
        """Stop every live worker (SIGTERM, then SIGKILL after the grace period) and reap it."""
        with self._lock:
            procs = [p for p in self._procs.values() if attempt is None or p.attempt <= attempt]
            for p in procs:
                if p.state == "running":
                    p.state = "stopped"
        for p in procs:
            if p.popen.poll() is None:
                signal_group(p.popen, signal.SIGTERM)
        deadline = time.monotonic() + (self.cfg.stop_grace_s if grace_s is None else grace_s)
        for p in procs:
            try:
                p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            signal_group(p.popen, signal.SIGKILL)  # also reaps any child the worker left
            p.popen.wait()
            if p.reader is not None:
                p.reader.join(timeout=1.0)
        with self._lock:
            for p in procs:
                if self._procs.get(p.rank) is p:
                    del self._procs[p.rank]

    def _send(self, msg: m.Message) -> bool:
        if self._conn is None:
            return False
        try:
            self._conn.send(msg)
            return True
        except (OSError, ProtocolError) as exc:
            log.warning("agent %d: could not send %s: %s", self.node_rank, type(msg).__name__, exc)
            return False

