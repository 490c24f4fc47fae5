"""What the controller's pieces see of it: the :class:`Hub` contract the
:class:`~unbroken.controller.server.Controller` fulfils for its connections and executor
(typed here so that neither imports the server, which builds them), and the two actions that
answer a message directly (:class:`Reply`, :class:`TellAgents`).

Who does what:

* connections (:mod:`~unbroken.controller.connections`) turn frames into events
  (:meth:`Hub.apply`), note what agents and workers report on the
  :class:`~unbroken.controller.board.Board`, and read its views; they send nothing;
* the executor (:mod:`~unbroken.controller.executor`) alone carries out actions, the state
  machine's and these two, and sends;
* the board is the one owner of what both change; the machine's state (:attr:`Hub.state`) is the
  server's, read-only here. The rest are services with their own small interfaces: the event log,
  recovery timing, the ranks' own states, the store service, the storage tier.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

from unbroken.checkpoint.storage import StorageTier
from unbroken.config import LaunchConfig
from unbroken.controller.api import JobState
from unbroken.controller.board import Board
from unbroken.controller.events import Event
from unbroken.controller.eventlog import EventLog
from unbroken.controller.liveness import Liveness
from unbroken.controller.rank_state import RankStates
from unbroken.controller.store_service import StoreService
from unbroken.controller.summaries import NodeSummaries
from unbroken.controller.timing import RecoveryTiming
from unbroken.protocol.messages import Message
from unbroken.protocol.wire import Connection


@dataclass(frozen=True)
class Reply:
    """Answer one connection directly (a fault claim, an agent that does not fit the job)."""

    conn: Connection
    msg: Message


@dataclass(frozen=True)
class TellAgents:
    """Send ``msg`` to one agent (``agent``) or to every agent (None)."""

    msg: Message
    agent: int | None = None


class Hub(Protocol):
    """The controller as its pieces see it; used only under :attr:`lock`."""

    cfg: LaunchConfig
    host: str
    events: EventLog
    lock: threading.RLock
    board: Board
    storage: StorageTier | None
    timing: RecoveryTiming
    liveness: Liveness
    rank_states: RankStates
    store_service: StoreService
    summaries: NodeSummaries

    @property
    def state(self) -> JobState: ...

    def apply(self, event: Event) -> None: ...

    def reply(self, action: Reply | TellAgents) -> None: ...

    def step_completed(self, rank: int, attempt: int, step: int, metrics: dict, t: float | None = None) -> None: ...

    def step_committed(self, gen: int, step: int) -> None: ...

    def degraded(self, rank: int, attempt: int, reason: str) -> None: ...

    def terminate(self, reason: str) -> None: ...

    def refused(self, node_rank: int, standby: bool) -> str: ...
