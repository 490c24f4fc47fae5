"""What the controller's pieces share and change: the one owner of it, :class:`Board`.

The :class:`~unbroken.controller.server.Controller` builds one; its connections
(:mod:`~unbroken.controller.connections`: what agents and workers report) and its executor
(:mod:`~unbroken.controller.executor`: what the state machine ordered) change it only through
the methods below, each named for what happened, and read it through :meth:`Board.view`,
:meth:`Board.views` and the read-only properties. Nothing else writes a :class:`RankView`.
Everything runs under the controller's lock; :meth:`Board.wait` is the one exception (an
:class:`threading.Event`).

What it holds: each rank's view (what the controller knows of it in the current attempt, its
control connection included), each agent's control connection, the fault ids of the injection
plan already claimed, what the script imported (for the agents' warm spares), the control
messages counted by type, the deadline of the in-flight recovery in progress, and how the job
ended.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Iterable

from unbroken.controller.views import Outcome, RankView
from unbroken.names import Phase, WorkerState
from unbroken.protocol.messages import spare_import_names
from unbroken.protocol.wire import Connection


@dataclasses.dataclass
class MessageCounts:
    """How many control messages of each type the workers sent and got."""

    received: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    sent: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    # Step messages that travel between the controller and agents for their ranks (NodeReports in,
    # CommitStep out: counted in received/sent too) and the worker reports inside the batches.
    relayed: collections.Counter = dataclasses.field(default_factory=collections.Counter)


class Board:
    """The controller's shared, changing state (see the module docstring)."""

    def __init__(self, world_size: int, nnodes: int) -> None:
        self._nnodes = nnodes
        self._workers = {r: RankView(rank=r) for r in range(world_size)}
        self._agents: dict[int, Connection] = {}
        self._fired: set[str] = set()
        self._spare_imports: list[str] | None = None
        self._counts = MessageCounts()
        self._recovery_deadline: tuple[int, float] | None = None  # (generation, monotonic deadline)
        self._outcome: Outcome | None = None
        self._done = threading.Event()

    # -- reads ---------------------------------------------------------------------------------
    def view(self, rank: int) -> RankView:
        return self._workers[rank]

    def views(self) -> Iterable[RankView]:
        return self._workers.values()

    def ranks(self) -> set[int]:
        return set(self._workers)

    def last_steps(self) -> tuple[int | None, ...]:
        """Each rank's last reported step (None: none yet), in rank order."""
        return tuple(w.step for w in self._workers.values())

    def any_finishing(self) -> bool:
        """Some rank left its step loop and has not exited yet."""
        return any(w.state is WorkerState.FINISHING for w in self._workers.values())

    def agent_conn(self, agent: int) -> Connection | None:
        return self._agents.get(agent)

    def agent_ids(self) -> list[int]:
        return list(self._agents)

    @property
    def spare_imports(self) -> list[str] | None:
        return self._spare_imports

    @property
    def counts(self) -> MessageCounts:
        """A copy: the counts so far."""
        c = self._counts
        return MessageCounts(collections.Counter(c.received), collections.Counter(c.sent),
                             collections.Counter(c.relayed))

    @property
    def recovery_deadline(self) -> tuple[int, float] | None:
        return self._recovery_deadline

    @property
    def outcome(self) -> Outcome | None:
        return self._outcome

    def is_done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float | None) -> bool:
        """Block until the job ended or the controller closed (any thread, no lock needed)."""
        return self._done.wait(timeout_s)

    # -- agents (connections.py) -------------------------------------------------------------
    def agent_joined(self, node: int, conn: Connection, *, standby: bool) -> int:
        """An agent registered: its id (a node's agent: its node rank; a spare: the next id after them)."""
        agent = max([self._nnodes - 1, *self._agents]) + 1 if standby else node
        self._agents[agent] = conn
        return agent

    def agent_left(self, agent: int, conn: Connection) -> bool:
        """``conn`` of ``agent`` closed: True when it was the agent's current one (now gone)."""
        if self._agents.get(agent) is not conn:
            return False
        del self._agents[agent]
        return True

    # -- workers' processes, as their agents see them (connections.py) ------------------------
    def process_started(self, rank: int, pid: int, attempt: int, now: float, agent: int = -1) -> None:
        w = self._workers[rank]
        w.pid, w.attempt, w.started_t, w.last_progress_t, w.agent = pid, attempt, now, now, agent
        w.step, w.phase, w.state, w.steps_in_generation = None, Phase.STARTING, WorkerState.STARTING, 0
        w.process, w.process_t, w.exited_t = "running", now, None
        w.in_step_loop = w.relayed = False
        w.compute_s.clear()

    def process_exited(self, rank: int, exit_code: int | None, now: float) -> bool:
        """The rank's process exited; True when it had left its step loop before (no fault: loop_end.py)."""
        w = self._workers[rank]
        after_loop = w.state is WorkerState.FINISHING
        w.state = WorkerState.FINISHED if exit_code == 0 else WorkerState.FAILED
        w.exited_t = now
        return after_loop

    def process_status(self, rank: int, pid: int, attempt: int, status: str, now: float) -> bool:
        """The agent saw the process stopped, a zombie or running again; False (nothing changed)
        when ``pid``/``attempt`` is not the rank's current process."""
        w = self._workers.get(rank)
        if w is None or w.pid != pid or w.attempt != attempt:
            return False
        w.process, w.process_t = status, now
        return True

    # -- the workers' own reports (connections.py) ---------------------------------------------
    def connected(self, rank: int, conn: Connection, *, relayed: bool) -> None:
        w = self._workers[rank]
        w.conn, w.state, w.relayed = conn, WorkerState.RUNNING, relayed

    def reported(self, rank: int, phase: str, *, in_loop: bool) -> None:
        """The rank is in ``phase``; ``in_loop``: the report was of a step (it entered job.steps())."""
        w = self._workers[rank]
        w.in_step_loop = w.in_step_loop or in_loop
        w.phase = phase

    def step_done(self, rank: int, step: int, metrics: dict, now: float) -> float | None:
        """The rank completed ``step`` steps with ``metrics``; its ``compute_s`` (measured by the rank:
        the step's start to its first collective) feeds the straggler rule. Returns how long the step
        took, when it was not the rank's first of its generation (the watchdog's median), else None."""
        w = self._workers[rank]
        compute_s = metrics.get("compute_s")
        if isinstance(compute_s, (int, float)) and not isinstance(compute_s, bool) and compute_s >= 0:
            w.compute_s.append(float(compute_s))
        took = now - w.last_progress_t if w.steps_in_generation else None
        w.last_progress_t = now
        w.steps_in_generation += 1
        w.step, w.metrics = step, dict(metrics)
        return took

    def synced(self, rank: int) -> None:
        """Its reduction is done and it joined the step's commit vote (it reports after joining)."""
        self._workers[rank].phase = Phase.VOTE

    def finishing(self, rank: int) -> None:
        """It left its step loop (its final save, job.close() may follow)."""
        self._workers[rank].state = WorkerState.FINISHING

    def claim(self, fault_id: str) -> bool:
        """True for the first claim of ``fault_id`` (the injection plan's faults fire once per job)."""
        granted = fault_id not in self._fired
        self._fired.add(fault_id)
        return granted

    def script_imported(self, modules: object) -> list[str] | None:
        """The first report of what the script imported (checked names); None for any later one."""
        if self._spare_imports is not None:
            return None
        self._spare_imports = spare_import_names(modules)
        return self._spare_imports

    def count_received(self, name: str, *, relayed: bool = False) -> None:
        (self._counts.relayed if relayed else self._counts.received)[name] += 1

    # -- what the executor carried out (executor.py) ----------------------------------------------
    def count_sent(self, name: str, *, relayed: bool = False) -> None:
        self._counts.sent[name] += 1
        if relayed:
            self._counts.relayed[name] += 1

    def attempt_started(self) -> None:
        for w in self._workers.values():
            w.state, w.steps_in_generation = WorkerState.STARTING, 0

    def restarting(self, rank: int) -> None:
        """Its agent is told to start it again: no process, no connection until it registers."""
        w = self._workers[rank]
        w.state, w.conn, w.pid = WorkerState.STARTING, None, 0

    def recovered(self, now: float) -> None:
        """An in-flight recovery is over: paused ranks made no progress on purpose; the redo step is
        a first step (new connections, a cold replacement: the watchdog's first-step timeout)."""
        self._recovery_deadline = None
        for w in self._workers.values():
            w.last_progress_t, w.steps_in_generation = now, 0

    def recovery_ordered(self, gen: int, deadline_t: float) -> None:
        self._recovery_deadline = (gen, deadline_t)

    def recovery_dropped(self) -> None:
        """No in-flight recovery to time any more (another rung was decided)."""
        self._recovery_deadline = None

    def recovery_expired(self, now: float) -> int | None:
        """The generation whose recovery is past its deadline at ``now`` (once), else None."""
        if self._recovery_deadline is None or now <= self._recovery_deadline[1]:
            return None
        gen, self._recovery_deadline = self._recovery_deadline[0], None
        return gen

    def finish(self, outcome: Outcome) -> bool:
        """The job ended with ``outcome``; False (nothing changed) when it had ended already. The
        executor calls :meth:`close` once it told everyone."""
        if self._outcome is not None:
            return False
        self._outcome = outcome
        return True

    def close(self) -> None:
        """The job is over, or the controller stops serving: :meth:`wait` returns."""
        self._done.set()
