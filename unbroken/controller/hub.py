"""What the controller's pieces share: the :class:`Hub` contract the
:class:`~unbroken.controller.server.Controller` fulfils for its connections and executor
(typed here so that neither imports the server, which builds them)."""

from __future__ import annotations

import threading
from typing import Protocol

from unbroken.checkpoint.storage import StorageTier
from unbroken.config import LaunchConfig
from unbroken.controller.api import JobState
from unbroken.controller.events import Event
from unbroken.controller.eventlog import EventLog
from unbroken.controller.liveness import Liveness
from unbroken.controller.monitor import Monitor
from unbroken.controller.rank_state import RankStates
from unbroken.controller.store_service import StoreService
from unbroken.controller.timing import RecoveryTiming
from unbroken.controller.views import Outcome, WorkerView
from unbroken.protocol.messages import Message
from unbroken.protocol.wire import Connection


class Sender(Protocol):
    """Sending to agents and workers (:class:`~unbroken.controller.connections.Connections`)."""

    agents: dict[int, Connection]

    def send_to_agent(self, node: int, msg: Message) -> None: ...

    def broadcast_agents(self, msg: Message) -> None: ...

    def send_to_workers(self, msg: Message, ranks: set[int] | None = None) -> None: ...


class StepListener(Protocol):
    """Live status and metrics (:class:`unbroken.ops.monitor.JobMonitor`): told of each completed step."""

    def on_step(self, rank: int, step: int, metrics: dict) -> None: ...


class Hub(Protocol):
    """The controller's shared state and operations; used only under :attr:`lock`."""

    cfg: LaunchConfig
    host: str
    events: EventLog
    lock: threading.RLock
    state: JobState
    workers: dict[int, WorkerView]
    fired: set[str]
    outcome: Outcome | None
    done: threading.Event
    recovery_deadline: tuple[int, float] | None
    storage: StorageTier | None
    timing: RecoveryTiming
    monitor: Monitor
    liveness: Liveness
    rank_states: RankStates
    connections: Sender
    store_service: StoreService
    live: StepListener

    def apply(self, event: Event) -> None: ...

    def degraded(self, rank: int, attempt: int, reason: str) -> None: ...

    def terminate(self, reason: str) -> None: ...

    def check_recovered(self) -> None: ...
