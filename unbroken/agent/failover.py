"""Controller failover in the agents (``--controller-store``, issue 29).

With the flag, every agent of a multi-node job (the standby agents too) runs a
:class:`SeatHost`: a :class:`~unbroken.consensus.seat.ControllerSeat` in etcd plus the controller
it starts when it leads. Node 0 campaigns at once, so a job starts as it does without the flag,
its controller in node 0's agent; the others campaign only once a leader has appeared, and then
stand by. Every agent finds the leading controller's address in etcd (:class:`EtcdLeader`) and
follows the next one when its controller is lost (:meth:`unbroken.agent.agent.Agent.run`).

The leader mirrors the controller's durable state into etcd (:class:`DurableMirror`: attempt,
generation, committed step, restart budget, placement, replica layout, the job's end) with writes
fenced by its term, and with it the commit log: each step its controller commits, stamped with the
term (:mod:`unbroken.consensus.step_log`). A seat that wins after a lost leader starts its controller from that state:
the job restarts from the memory tier, with the previous leader's node lost
(:mod:`unbroken.controller.takeover`). A leader whose term ends (lease lost, a write refused) fences
its controller at once (:meth:`unbroken.controller.server.Controller.fence`).

Threads: the seat's (``unbroken-controller-seat``; it calls ``on_lead``), the lease keepalive's (it
calls ``on_fenced``), the mirror's (``unbroken-durable-mirror``) and, on nodes other than 0, one
that waits for the first leader before campaigning. Guarded by :attr:`SeatHost._lock`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable

from unbroken.config import LaunchConfig
from unbroken.consensus.durable import DurableState, DurableStore, job_prefix
from unbroken.consensus.election import Fenced, Term, wait_for_leader
from unbroken.consensus.etcd import EtcdClient, EtcdError
from unbroken.consensus.seat import ControllerSeat
from unbroken.consensus.step_log import CommitEntry
from unbroken.controller import machine as sm
from unbroken.controller.durable_mirror import agent_name, durable_from_job, layout_key
from unbroken.controller.server import Controller
from unbroken.controller.takeover import Takeover

log = logging.getLogger(__name__)

__all__ = ["DurableMirror", "EtcdLeader", "Leadership", "SeatHost", "seat_address"]

#: How long a node other than 0 waits for the job's first leader before it campaigns anyway.
FIRST_LEADER_WAIT_S = 120.0
ETCD_TIMEOUT_S = 2.0
MIRROR_RETRY_S = 0.5  # after etcd refused a durable write (no quorum, over a limit), before the next try



@dataclass(frozen=True)
class Leadership:
    """What a controller started by a seat is given of the term it acts for."""
    term: int  # the term (the leader key's create revision)
    holds: Callable[[], bool]  # whether the term still holds, by this host's clock
    durable: Callable[[sm.JobState], None]  # its durable listener (the mirror's offer)
    commits: Callable[[dict], None]  # its commit listener (the mirror's committed)


#: (host, port, takeover or None for a fresh job, the term) -> a started controller.
StartController = Callable[[str, int, "Takeover | None", Leadership], Controller]


def seat_address(cfg: LaunchConfig) -> tuple[str, int]:
    """Where this agent's controller would listen: node 0's is the job's --master-addr/--master-port;
    another agent's is the address it reaches node 0 from, on a free port."""
    if cfg.node_rank == 0 and not cfg.standby:
        return cfg.master_addr, cfg.master_port
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((cfg.master_addr, cfg.master_port or 9))  # no packet is sent: picks the interface
            host = probe.getsockname()[0]
        except OSError:
            host = cfg.master_addr
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as free:
        free.bind((host, 0))
        return host, free.getsockname()[1]


def _holds(term: Term) -> bool:
    """The term still holds by the leader's own clock (Term.check without raising)."""
    return not term.lost.is_set() and time.monotonic() < term.valid_until


class EtcdLeader:
    """The agent's :class:`~unbroken.agent.agent.LeaderSource`: the leader's address from etcd."""

    def __init__(self, client: EtcdClient, prefix: bytes) -> None:
        self._client, self._prefix = client, prefix

    def find(self, *, after_term: int, timeout_s: float) -> tuple[str, int, int]:
        leader = wait_for_leader(self._client, self._prefix, timeout_s=timeout_s, newer_than=after_term)
        host, _, port = leader.address.rpartition(":")
        return host, int(port), leader.term


class DurableMirror:
    """The leading controller's durable state into etcd, off the controller's lock: :meth:`offer`
    keeps the newest state, the thread writes it (fenced by ``term``); older ones are skipped.
    Where only the committed step moved since the last write (a steady step), only the step is
    written. :meth:`committed` queues a commit log entry: every one is written, with the next state.
    A write etcd refuses is tried again, with what came since, after ``retry_s``."""

    def __init__(self, store: DurableStore, term: Term, on_fenced: Callable[[Term], None], *,
                 retry_s: float = MIRROR_RETRY_S) -> None:
        self._store, self._term, self._on_fenced, self._retry_s = store, term, on_fenced, retry_s
        self._cond = threading.Condition()
        self._pending: sm.JobState | None = None
        self._written_layout: tuple | None = None  # layout_key of the state last written (the thread's)
        self._steps: list[CommitEntry] = []
        self.refused_steps = 0  # commit log entries not written, the term being over: the event log has them
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="unbroken-durable-mirror", daemon=True)
        self._thread.start()

    def offer(self, state: sm.JobState) -> None:
        with self._cond:
            self._pending = state
            self._cond.notify()

    def committed(self, record: dict) -> None:
        """The controller's ``step_committed`` record: an entry of the commit log in etcd."""
        entry = CommitEntry(term=self._term.revision, attempt=int(record["attempt"]), gen=int(record["gen"]),
                            step=int(record["step"]), node=self._term.node, t=float(record["t"]))
        with self._cond:
            self._steps.append(entry)
            self._cond.notify()

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is pending, then stop."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._steps and not self._closed:
                    self._cond.wait()
                state, self._pending = self._pending, None
                steps, self._steps = self._steps, []
                if state is None and not steps:
                    return
            layout = None if state is None else layout_key(state)
            durable = None
            if state is not None and layout != self._written_layout:  # O(ranks): only when more than the step moved
                durable = replace(durable_from_job(state), finished=state.phase in sm.FINAL_PHASES)
            try:
                self._store.save(self._term, durable, steps,
                                 committed_step=None if state is None else state.committed_step)
                if layout is not None:
                    self._written_layout = layout
            except Fenced:
                with self._cond:
                    self.refused_steps += len(steps) + len(self._steps)
                log.warning("controller %s: term %d is over: %d commit log entries not written to etcd (its event "
                            "log has them)", self._term.node, self._term.revision, self.refused_steps)
                self._on_fenced(self._term)
                return
            except EtcdError as exc:  # no quorum for a moment: written again with what comes next
                log.warning("controller: could not mirror the job state into etcd (again in %g s): %s",
                            self._retry_s, exc)
                with self._cond:
                    self._pending = self._pending or state
                    self._steps = steps + self._steps
                    if not self._closed:
                        self._cond.wait(self._retry_s)  # not a busy loop on a write etcd refuses at once
                if self._closed:
                    return  # closing: what is left is in the event log


class SeatHost:
    """One agent's seat and the controller it runs while it leads (see the module docstring)."""

    def __init__(self, cfg: LaunchConfig, start_controller: StartController) -> None:
        self.cfg = cfg
        self.client = EtcdClient(cfg.controller_store, timeout_s=ETCD_TIMEOUT_S)
        self.prefix = job_prefix(cfg.secret, cfg.job_id)
        self.leader = EtcdLeader(self.client, self.prefix)
        self.host, self.port = seat_address(cfg)
        self.node = agent_name(cfg.node_rank) if not cfg.standby else f"standby-{socket.gethostname()}-{os.getpid()}"
        self._start_controller = start_controller
        self._lock = threading.Lock()
        self._closed = False
        self._led = False  # this seat led before (node 0's first term starts the job fresh)
        self.controller: Controller | None = None
        self._mirror: DurableMirror | None = None
        self._seat = ControllerSeat(self.client, self.prefix, node=self.node, address=f"{self.host}:{self.port}",
                                    ttl_s=cfg.controller_lease_s, on_lead=self._on_lead, on_fenced=self._on_fenced)

    @property
    def first(self) -> bool:
        """This agent campaigns at once: node 0's."""
        return self.cfg.node_rank == 0 and not self.cfg.standby

    def start(self) -> None:
        if self.first:
            self._seat.start()
        else:
            threading.Thread(target=self._stand_by, name="unbroken-seat-standby", daemon=True).start()

    def _stand_by(self) -> None:
        try:
            wait_for_leader(self.client, self.prefix, timeout_s=FIRST_LEADER_WAIT_S)
        except TimeoutError:
            log.warning("agent %s: no controller leads the job in etcd after %.0f s; campaigning", self.node,
                        FIRST_LEADER_WAIT_S)
        with self._lock:
            if not self._closed:
                self._seat.start()

    def _on_lead(self, term: Term, state: DurableState | None) -> None:
        with self._lock:
            if self._closed:
                return
            if state is not None and state.finished:
                log.info("agent %s leads (term %d) a job that has ended: no controller", self.node, term.revision)
                return
            takeover = None if self.first and not self._led else self._takeover(term, state)
            self._led = True
            mirror = DurableMirror(self._seat.store, term, self._on_fenced)
            leadership = Leadership(term.revision, lambda: _holds(term), mirror.offer, mirror.committed)
            try:
                controller = self._start_controller(self.host, self.port, takeover, leadership)
            except Exception as exc:  # (its port taken, say) give the term up: another seat may lead
                log.error("agent %s won the controller's lead (term %d) but could not start a controller on "
                          "%s:%d: %s; giving the lead up", self.node, term.revision, self.host, self.port, exc)
                mirror.close(0)
                term.lost.set()  # the keepalive ends the term: the seat campaigns again after the lease
                return
            self.controller, self._mirror = controller, mirror
            log.warning("agent %s leads the job's controller at %s:%d (term %d%s)", self.node, self.host, self.port,
                        term.revision, ", taking over" if takeover else "")

    def _takeover(self, term: Term, state: DurableState | None) -> Takeover:
        """What the previous leader left, and its node (lost with it)."""
        try:
            terms = self._seat.store.terms()
        except EtcdError:
            terms = {}
        earlier = [t for t in terms if t < term.revision]
        previous = terms[max(earlier)] if earlier else ""
        lost = frozenset({int(previous.removeprefix("agent"))}) if previous.removeprefix("agent").isdigit() \
            else frozenset()
        durable = state if state is not None else DurableState(restart_budget=self.cfg.recovery.max_restarts)
        return Takeover(durable, lost, previous)

    def _on_fenced(self, term: Term) -> None:
        with self._lock:
            controller, mirror = self.controller, self._mirror
            self.controller = self._mirror = None
        if controller is not None:
            log.warning("agent %s: controller term %d ended; it stops acting now", self.node, term.revision)
            controller.fence(f"leadership term {term.revision} ended (lease lost or another controller leads)")
        if mirror is not None and threading.current_thread() is not mirror._thread:
            threading.Thread(target=mirror.close, name="unbroken-mirror-close", daemon=True).start()

    def close(self) -> None:
        """The job ended here: write the last state, resign the term, stop standing by."""
        with self._lock:
            self._closed = True
            mirror = self._mirror
        if mirror is not None:
            mirror.close()
        self._seat.close()
