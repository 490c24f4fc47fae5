"""What the controller knows of each rank and how a job ended: mutable views, owned by the
:class:`~unbroken.controller.server.Controller` and changed only under its lock."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from unbroken.controller import health
from unbroken.names import Phase, WorkerState
from unbroken.protocol.wire import Connection


@dataclass
class RankView:
    """What the controller knows of one rank in the current attempt."""

    rank: int
    pid: int = 0
    agent: int = -1  # the agent that started its process
    attempt: int = -1
    started_t: float = 0.0
    last_progress_t: float = 0.0
    step: int | None = None  # steps completed, as last reported
    phase: str = Phase.STARTING
    steps_in_generation: int = 0  # steps completed since its attempt began or the last in-flight recovery
    in_step_loop: bool = False  # it reported a phase of a step (entered job.steps()) in this attempt
    metrics: dict[str, Any] = field(default_factory=dict)
    compute_s: deque[float] = field(default_factory=lambda: deque(maxlen=health.WINDOW))  # as it measured them
    state: WorkerState = WorkerState.STARTING
    conn: Connection | None = None
    relayed: bool = False  # its step reports come, and its commits go, through its agent (agent/relay.py)
    process: str = "running"  # as its agent sees the process: running | stopped | zombie (hangs.py)
    process_t: float = 0.0  # when its agent reported ``process`` (monotonic): how long it has been stopped
    exited_t: float | None = None  # when its process exited (monotonic), in this attempt


@dataclass
class Outcome:
    """How the job ended: the exit code of `unbroken run` and why."""

    exit_code: int
    reason: str
