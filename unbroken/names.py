"""The vocabulary every package shares: recovery rungs, step phases, worker states.

One word per thing. A *rank* is the training identity: every act about one (started, exited,
killed, restarted, paused, resumed, hung, damaged, degraded) says *rank*, in the same word on the
wire (``messages.KillRank``, type ``kill_rank``), in the controller's machine (``KillRank``) and in
the event log (``kill_rank``). *Worker* means only the OS process that runs a rank and what it is
told: the ``unbroken.worker`` package inside it, ``WorkerConfig``/``WorkerSettings``, the agent's
``WorkerProc`` and :class:`WorkerState` below.

String enums, so a value is its wire and log spelling (``Rung.RECOVER_IN_PLACE ==
"recover-in-place"``) and messages, events and configs keep carrying plain strings. Pure:
no imports from the rest of the package, so anything may import it.
"""

from __future__ import annotations

import enum


class Rung(enum.StrEnum):
    """Strategies of the recovery ladder, cheapest first (DESIGN.md section 6)."""

    RETRY = "retry"
    RECOVER_IN_PLACE = "recover-in-place"
    RECOVER = "recover"
    ELASTIC = "elastic"
    DUMP = "dump"
    EXIT = "exit"


#: Every rung, in ladder order.
RUNGS: tuple[Rung, ...] = tuple(Rung)
#: Rungs that keep the processes of the job (the survivors stay alive).
IN_FLIGHT_RUNGS = frozenset({Rung.RETRY, Rung.RECOVER_IN_PLACE, Rung.RECOVER, Rung.DUMP})
#: Rungs that start replacement processes for lost ranks inside the running job.
REPLACING_RUNGS = frozenset({Rung.RECOVER_IN_PLACE, Rung.RECOVER})


class Phase(enum.StrEnum):
    """Where a rank is, as it reports it: the phases of a step and what surrounds them.

    A step runs ``compute`` -> ``sync`` -> ``update`` -> ``done``; ``checkpoint`` and
    ``restore`` are the points where checkpoint/restore faults fire, ``vote`` a rank waiting in
    a step's commit vote (its reduction done; a fault ``at=vote`` fires just before it joins),
    ``collective`` a rank of a step's compute blocked in a broadcast or gather (DDP's buffers);
    ``starting`` is a rank that has not reported yet and ``finished`` one past its step loop.
    """

    STARTING = "starting"
    COMPUTE = "compute"
    SYNC = "sync"
    UPDATE = "update"
    DONE = "done"
    CHECKPOINT = "checkpoint"
    RESTORE = "restore"
    VOTE = "vote"
    COLLECTIVE = "collective"  # (a mark only) waiting in a collective that is not a reduction, in compute
    FINISHED = "finished"


#: The phases of one step, in order (the consistency rule reasons over these).
STEP_PHASES: tuple[Phase, ...] = (Phase.COMPUTE, Phase.SYNC, Phase.UPDATE, Phase.DONE)
#: The phases a planned fault may fire at (``--inject ...:at=PHASE``).
FAULT_PHASES: tuple[Phase, ...] = (Phase.COMPUTE, Phase.SYNC, Phase.VOTE, Phase.UPDATE, Phase.CHECKPOINT,
                                   Phase.RESTORE)


class WorkerState(enum.StrEnum):
    """The controller's view of one rank's process in the current attempt.

    ``starting`` (started, or restarted for a recovery) -> ``running`` (registered) ->
    ``finishing`` (past its step loop) -> ``finished`` (exit 0); ``failed`` when it exited
    non-zero. A rank restarted in flight goes back to ``starting``.
    """

    STARTING = "starting"
    RUNNING = "running"
    FINISHING = "finishing"
    FINISHED = "finished"
    FAILED = "failed"


#: States of a process the controller still talks to.
LIVE_WORKER_STATES = frozenset({WorkerState.STARTING, WorkerState.RUNNING})

#: The worker event that carries the modules the script imported (worker/script_imports.py): the
#: controller passes them on to the agents' warm spares (protocol message SpareImports).
SCRIPT_IMPORTS_EVENT = "script_imports"
