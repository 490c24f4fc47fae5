"""The job's Prometheus metrics, fed from its event-log records.

:class:`JobMetrics` owns one ``CollectorRegistry`` per job (never the process-wide default:
two jobs in one process must not share counters). :meth:`JobMetrics.observe` takes every
record the controller logs, in the controller's threads; prometheus_client's metrics are
thread-safe. Names follow Prometheus conventions: counters end in ``_total`` (the client
adds it), durations are ``_seconds`` histograms, sizes ``_bytes``.
"""

from __future__ import annotations

from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from unbroken.errors import EXIT_FATAL
from unbroken.ops import goodput

Record = dict[str, Any]

_STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_RECOVERY_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
_DAMAGE = {"memory_fault": "memory-fault", "non_finite": "non-finite", "sdc_detected": "sdc",
           "hang_detected": "hang", "sub_health": "sub-health", "agent_lost": "node-lost"}


class JobMetrics:
    """The metrics of one job; :meth:`observe` each event-log record, :meth:`exposition` to serve."""

    def __init__(self, world_size: int) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.steps = Counter("unbroken_steps_completed", "Job steps completed by every rank (redone steps too)",
                             registry=r)
        self.step_seconds = Histogram("unbroken_step_seconds", "Wall time of one job step (the slowest rank)",
                                      buckets=_STEP_BUCKETS, registry=r)
        self.faults = Counter("unbroken_faults", "Faults detected, by kind", ["kind"], registry=r)
        self.recoveries = Counter("unbroken_recoveries", "Recovery decisions, by rung of the ladder", ["rung"],
                                  registry=r)
        self.recovery_seconds = Histogram(
            "unbroken_recovery_seconds", "Seconds of each phase of a finished recovery "
            "(detect, replace, regroup, restore, redo)", ["phase"], buckets=_RECOVERY_BUCKETS, registry=r)
        self.steps_lost = Counter("unbroken_steps_lost", "Completed steps computed again after a fault",
                                  registry=r)
        self.ckpt_stall = Histogram("unbroken_checkpoint_stall_seconds",
                                    "Seconds a step was blocked by its checkpoint (the slowest rank)",
                                    buckets=_STEP_BUCKETS, registry=r)
        self.ckpt_persist = Histogram("unbroken_checkpoint_persist_seconds",
                                      "Seconds to write one snapshot to the storage tier", ["tier"],
                                      buckets=_RECOVERY_BUCKETS, registry=r)
        self.memory_tier_bytes = Gauge("unbroken_memory_tier_bytes",
                                       "Bytes of the shared-memory snapshot slots of every rank", registry=r)
        self.ranks_alive = Gauge("unbroken_ranks_alive", "Ranks whose process runs now", registry=r)
        self.world_size = Gauge("unbroken_world_size", "Ranks of the job", registry=r)
        self.generation = Gauge("unbroken_generation", "Process-group generation (+1 per in-flight recovery)",
                                registry=r)
        self.attempt = Gauge("unbroken_attempt", "Job attempt (+1 per job restart)", registry=r)
        self.goodput = Gauge("unbroken_goodput_ratio", "Productive share of the wall time so far", registry=r)
        self.world_size.set(world_size)
        self._killed: set[int] = set()  # ranks the controller killed (their exit is not a new fault)
        self._stopping = False  # workers of a stopped attempt exit: not faults
        self._handlers: dict[str, Callable[[Record], None]] = {
            "step": self._on_step, "decision": self._on_decision, "kill_rank": self._on_kill,
            "rank_exited": self._on_exit, "stop_ranks": self._on_stop, "attempt_started": self._on_attempt,
            "abort_generation": self._on_gen, "regroup": self._on_gen, "checkpoint_persisted": self._on_persist,
            "checkpoint_saved": self._on_persist}

    def observe(self, record: Record, recent: Callable[[], list[Record]]) -> None:
        """Count one event-log record; ``recent()`` gives the log so far (for a finished recovery)."""
        name = record.get("event", "")
        if name in _DAMAGE:
            self.faults.labels(kind=_DAMAGE[name]).inc()
        elif name == "recovered":
            self._on_recovered(record, recent())
        handler = self._handlers.get(name)
        if handler is not None:
            handler(record)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    # -- handlers ------------------------------------------------------------------------
    def _on_step(self, r: Record) -> None:
        self.steps.inc()
        self.step_seconds.observe(float(r.get("step_s") or 0.0))
        if r.get("ckpt_s"):
            self.ckpt_stall.observe(float(r["ckpt_s"]))
        if r.get("shm_bytes") is not None:
            self.memory_tier_bytes.set(r["shm_bytes"])

    def _on_decision(self, r: Record) -> None:
        self.recoveries.labels(rung=r.get("rung", "?")).inc()

    def _on_kill(self, r: Record) -> None:
        self._killed.add(r.get("rank"))

    def _on_stop(self, r: Record) -> None:
        self._stopping = True

    def _on_attempt(self, r: Record) -> None:
        self._stopping = False
        self._killed.clear()
        self.attempt.set(r.get("attempt", 0))

    def _on_gen(self, r: Record) -> None:
        self.generation.set(r.get("gen", 0))

    def _on_exit(self, r: Record) -> None:
        rank = r.get("rank")
        if rank in self._killed:
            self._killed.discard(rank)
            return
        if self._stopping or (r.get("exit_code") == 0 and not r.get("signal")):
            return
        self.faults.labels(kind="fatal" if r.get("exit_code") == EXIT_FATAL else
                           "crash" if r.get("signal") else "exit").inc()

    def _on_persist(self, r: Record) -> None:
        if r.get("seconds") is not None:
            self.ckpt_persist.labels(tier=r.get("tier", "storage")).observe(float(r["seconds"]))

    def _on_recovered(self, r: Record, events: list[Record]) -> None:
        done = [x for x in goodput.recoveries(events) if abs(x.end_t - r["t"]) < 1e-6]
        if not done:
            return
        rec = done[-1]
        for phase in goodput.PHASES:
            self.recovery_seconds.labels(phase=phase).observe(rec.seconds(phase))
        if rec.steps_redone:
            self.steps_lost.inc(rec.steps_redone)
