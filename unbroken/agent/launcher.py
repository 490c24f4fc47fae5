"""`unbroken run` as a function: node 0 hosts the controller, every node runs an agent.

:func:`run_job` prepares the run directory, starts the controller (node 0 only) and the
agent, blocks until the job ends, and returns a :class:`JobResult`. Ctrl-C stops every
worker and ends the job with exit code 130. The first SIGTERM goes to :class:`GracefulStop`:
the job dumps its newest committed step to --save where it can, then stops with exit code 143
(controller/terminate.py); where it cannot ask for that, and on a second SIGTERM, the CLI
raises :class:`Terminated` and the job stops at once as on Ctrl-C, with exit code 143. Every
worker gets SIGTERM, then SIGKILL after the stop grace period, and this node's shared-memory
files are removed.
"""

from __future__ import annotations

import os
import secrets
import signal
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, TextIO

from unbroken.agent.agent import Agent
from unbroken.agent.forks import Zygote
from unbroken.agent.pool import default_socket as default_pool_socket
from unbroken.config import LaunchConfig
from unbroken.controller.eventlog import EventLog
from unbroken.controller.machine import Failure
from unbroken.controller.server import Controller
from unbroken.controller.takeover import Takeover
from unbroken.errors import ConfigError
from unbroken.ops.live_view import LiveView

if TYPE_CHECKING:
    from unbroken.agent.failover import Leadership


class Terminated(KeyboardInterrupt):
    """Raised in the main thread when `unbroken run` gets SIGTERM (Kubernetes, Slurm): the job
    stops as on Ctrl-C. A KeyboardInterrupt, so every clean-up that Ctrl-C runs runs too."""

    signum = signal.SIGTERM


class GracefulStop:
    """What the first SIGTERM of one `unbroken run` does: the CLI's signal handler calls
    :meth:`request` (in the main thread); :func:`run_job` attaches its agent while it serves."""

    def __init__(self) -> None:
        self._agent: Agent | None = None

    def attach(self, agent: Agent | None) -> None:
        self._agent = agent

    def request(self, signum: int) -> bool:
        """True when the agent asked the controller to dump and stop the job; False: stop at once."""
        agent = self._agent
        return agent is not None and agent.request_stop(signum)


def _interruption(exc: KeyboardInterrupt) -> tuple[int, str]:
    """Exit code and reason of a job stopped by Ctrl-C or a signal (128 + its number)."""
    if isinstance(exc, Terminated):
        return 128 + exc.signum, f"terminated ({signal.Signals(exc.signum).name})"
    return 130, "interrupted (Ctrl-C)"


@dataclass(frozen=True)
class JobResult:
    exit_code: int
    reason: str
    run_dir: Path
    first_failure: Failure | None = None


def resolve(cfg: LaunchConfig) -> LaunchConfig:
    """Fill in what the user may leave out: job id, secret, absolute run dir. Checks the script."""
    if not Path(cfg.script).is_file():
        raise ConfigError(f"training script not found: {cfg.script!r} (give the path of a Python file)")
    job_id = cfg.job_id or secrets.token_hex(4)
    secret = cfg.secret or secrets.token_hex(32)
    run_dir = Path(cfg.run_dir).absolute()
    return replace(cfg, job_id=job_id, secret=secret, run_dir=run_dir)


def _prepare_run_dir(cfg: LaunchConfig) -> None:
    cfg.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = cfg.run_dir / ("config.standby.json" if cfg.standby else f"config.node{cfg.node_rank}.json")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(cfg.to_json() + "\n")


def _log_checkpoint_dirs(cfg: LaunchConfig, events: EventLog) -> None:
    """Event `checkpoint_dirs`: where this launch resumes from and saves to, and the notes."""
    from unbroken.checkpoint.launch_dirs import check_launch_dirs

    ckpt = cfg.checkpoint
    if ckpt.save_dir or ckpt.load_dir:
        events.emit("checkpoint_dirs", save_dir=ckpt.save_dir, load_dir=ckpt.load_dir,
                    notes=check_launch_dirs(ckpt.save_dir, ckpt.load_dir))


def _start_controller(cfg: LaunchConfig, events: EventLog, *, host: str = "", port: int | None = None,
                      takeover: Takeover | None = None, leadership: Leadership | None = None
                      ) -> tuple[Controller, LiveView]:
    """A controller (node 0's, or a new leader's: agent/failover.py) and the live view it feeds
    (status.json, /metrics, the page): built and joined here, so that the controller and the view
    know nothing of each other."""
    host = host or cfg.master_addr
    controller = Controller(cfg, host=host, port=cfg.master_port if port is None else port, events=events,
                            takeover=takeover, term_valid=leadership and leadership.holds,
                            term=leadership.term if leadership else 0)
    live = LiveView(run_dir=cfg.run_dir, job_id=cfg.job_id, world_size=cfg.world_size, events=events,
                    snapshot=controller.snapshot, host=host, metrics_port=cfg.metrics_port)
    events.listeners.append(live.on_record)  # status, metrics and the page follow the log
    controller.add_step_listener(live.on_step)  # and each completed step
    controller.add_job_step_listener(live.on_job_step)  # (under node summaries: the job's, from the summaries)
    if leadership is not None:
        controller.add_durable_listener(leadership.durable)
        controller.add_commit_listener(leadership.commits)
    try:
        live.start()
        controller.start()
    except BaseException:
        live.close()
        controller.close(drain_s=0)
        raise
    return controller, live


def run_job(cfg: LaunchConfig, *, output: TextIO | None = None,
            on_controller: Callable[[Controller], None] | None = None,
            graceful: GracefulStop | None = None) -> JobResult:
    """Run this node's part of a job to its end. ``cfg`` must come from :func:`resolve`;
    ``graceful`` gets the agent while it serves (SIGTERM: see the module docstring)."""
    _prepare_run_dir(cfg)
    # First of all: the zygote's imports (seconds of CPU) overlap the controller's start and the rendezvous.
    zygote = _zygote(cfg)
    try:
        if cfg.controller_store:
            return _run_with_seat(cfg, output=output, on_controller=on_controller, graceful=graceful, zygote=zygote)
        return _run_here(cfg, output=output, on_controller=on_controller, graceful=graceful, zygote=zygote)
    finally:
        if zygote is not None:
            zygote.close()  # (the agent closed it already, after its ranks stopped, unless it never ran)


def _zygote(cfg: LaunchConfig) -> Zygote | None:
    """The node's zygote: from the pool (agent/pool.py) when one listens on the pool socket, else its own."""
    if not cfg.fork_ranks:
        return None
    socket_path = Path(cfg.pool_socket) if cfg.pool_socket else default_pool_socket()
    if cfg.pool_socket or socket_path.exists():
        zygote = Zygote.connect(socket_path)
        if zygote is not None:
            return zygote
    return Zygote.start(cfg.omp_num_threads, str(cfg.run_dir))


def _run_here(cfg: LaunchConfig, *, output: TextIO | None, on_controller: Callable[[Controller], None] | None,
              graceful: GracefulStop | None, zygote: Zygote | None) -> JobResult:
    """Node 0 hosts the controller; every other node (and a standby) only runs its agent."""
    controller: Controller | None = None
    live: LiveView | None = None
    events: EventLog | None = None
    try:
        if cfg.node_rank == 0 and not cfg.standby:
            events = EventLog(cfg.run_dir)
            _log_checkpoint_dirs(cfg, events)
            controller, live = _start_controller(cfg, events)
            if on_controller is not None:
                on_controller(controller)
            host, port = cfg.master_addr, controller.port
        else:
            host, port = cfg.master_addr, cfg.master_port
        agent = Agent(cfg, host, port, output=output, zygote=zygote)
        return _serve(cfg, agent, lambda: controller, graceful)
    finally:
        if controller is not None:
            controller.close()
        if live is not None:
            live.close()  # the final status.json, after the controller's last records
        if events is not None:
            events.close()


def _serve(cfg: LaunchConfig, agent: Agent, controller_now: Callable[[], Controller | None],
           graceful: GracefulStop | None) -> JobResult:
    """Run ``agent`` to the job's end; the job's result as this node's controller (if it has one
    at the end) or its agent saw it."""
    if graceful is not None:
        graceful.attach(agent)
    try:
        interrupted = False
        try:
            code, reason = agent.run()
        except KeyboardInterrupt as exc:
            code, reason = _interruption(exc)
            interrupted = True
            controller = controller_now()
            if controller is not None:
                threading.Thread(target=controller.abort, args=(reason, code), daemon=True).start()
        controller = controller_now()
        failure = controller.first_failure if controller is not None else None
        # An interruption's code stands: the agent's clean-up (its workers stopped, its connection
        # closed) may reach the controller first and read there as a lost node (a failed job).
        if controller is not None and not interrupted:
            outcome = controller.wait(timeout_s=0)
            if outcome is not None:
                code, reason = outcome.exit_code, outcome.reason
        return JobResult(code, reason, cfg.run_dir, failure)
    finally:
        if graceful is not None:
            graceful.attach(None)


def _run_with_seat(cfg: LaunchConfig, *, output: TextIO | None, on_controller: Callable[[Controller], None] | None,
                   graceful: GracefulStop | None, zygote: Zygote | None) -> JobResult:
    """--controller-store: this agent runs a controller seat (agent/failover.py) and follows the
    leading controller, wherever it is."""
    from unbroken.agent.failover import SeatHost

    made: list[tuple[Controller, LiveView]] = []
    events: list[EventLog] = []

    def start_controller(host: str, port: int, takeover: Takeover | None, leadership: Leadership) -> Controller:
        if not events:
            events.append(EventLog(cfg.run_dir))
            _log_checkpoint_dirs(cfg, events[0])
        controller, live = _start_controller(cfg, events[0], host=host, port=port, takeover=takeover,
                                             leadership=leadership)
        made.append((controller, live))
        if on_controller is not None:
            on_controller(controller)
        return controller

    seat = SeatHost(cfg, start_controller)
    try:
        seat.start()
        agent = Agent(cfg, cfg.master_addr, cfg.master_port, output=output, leader=seat.leader, zygote=zygote)
        return _serve(cfg, agent, lambda: seat.controller, graceful)
    finally:
        seat.close()
        for controller, live in made:
            controller.close(drain_s=10.0 if controller is seat.controller else 0.0)
            live.close()
        for log in events:
            log.close()
