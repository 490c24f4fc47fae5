"""The live view of a job: fed by the controller, read by `unbroken status`, /metrics and the page.

(Not the controller's hang rule: that is :mod:`unbroken.controller.watchdog`.)

A :class:`LiveView` lives in the controller's process (node 0's agent). The launcher builds it and
hands it to the controller (agent/launcher.py): it is told of every event-log record and of each
completed step, and reads the controller's ``snapshot``; neither package imports the other. It owns the job's
metrics (:class:`~unbroken.ops.metrics.JobMetrics`), the job-level step records it adds to
the event log (one ``step`` record each time every rank has completed one more step: the
source of the goodput breakdown and the timeline), each rank's last fault, the
``status.json`` file of the run directory (rewritten every second by its own thread, mode
0600) and, with ``--metrics-port``, the HTTP server (:mod:`unbroken.ops.web`).

Threads: :meth:`on_record` and :meth:`on_step` run in the controller's threads (under its
lock: they update counters); the status thread calls the controller's ``snapshot``
(which takes that lock) and never holds the view's lock while doing so. A fault record
also rewrites ``status.json`` at once, in the thread that records it, so the file shows a
fault before the controller acts on it (an operator's `unbroken status` right after a fault
sees it; the periodic rewrite alone left it up to a second behind a recovery that takes less).
Writes are ordered: a status taken before a newer one was written is dropped, and nothing
replaces the final one.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Protocol

from unbroken.ops import goodput
from unbroken.ops.metrics import JobMetrics

log = logging.getLogger(__name__)

STATUS_FILE = "status.json"
STATUS_INTERVAL_S = 1.0
GOODPUT_INTERVAL_S = 5.0
#: The live goodput is read from every record since the start (one "step" record per job step): at
#: most this share of the status thread's time goes to it, however long the job has run.
GOODPUT_CPU_SHARE = 0.02
_FAULTS = {"hang_detected": "hang", "memory_fault": "memory fault", "non_finite": "NaN/Inf",
           "sdc_detected": "silent corruption", "sub_health": "degraded"}


class EventSink(Protocol):
    """What the view uses of the job's event log (:class:`unbroken.controller.eventlog.EventLog`)."""

    def emit(self, name: str, **fields: Any) -> None: ...

    def records(self) -> list[dict[str, Any]]: ...


class LiveView:
    """Live state of one job for status, metrics and the page (see the module docstring)."""

    def __init__(self, *, run_dir: str | os.PathLike, job_id: str, world_size: int, events: EventSink,
                 snapshot: Callable[[], dict[str, Any]], host: str = "127.0.0.1",
                 metrics_port: int | None = None) -> None:
        self.run_dir, self.job_id, self.world_size = Path(run_dir), job_id, world_size
        self.events, self._snapshot = events, snapshot
        self.metrics = JobMetrics(world_size)
        self._lock = threading.RLock()
        self._rank_steps: dict[int, int] = {}
        self._rank_metrics: dict[int, dict[str, Any]] = {}
        self._job_step = -1
        self._behind = world_size  # ranks not past _job_step (or not heard from): a step record waits for 0
        self._gen = 0
        self._last_fault: dict[int, str] = {}
        self._goodput_t = 0.0
        self._goodput_ratio = 0.0
        self._goodput_cost_s = 0.0  # what the last live goodput took to compute
        self._status_seq = 0  # counts the statuses taken (under _lock): orders the writes
        self._write_lock = threading.Lock()  # held only while writing the file, never while taking a lock
        self._written_seq, self._final_written = 0, False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._status_loop, name="unbroken-status", daemon=True)
        self._server = None
        if metrics_port is not None:
            from unbroken.ops.web import MetricsServer

            self._server = MetricsServer(self, host, metrics_port)
        self.address: str | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self._server is not None:
            self._server.start()
            self.address = self._server.address
            self.events.emit("metrics_started", address=self.address)
        self._thread.start()

    def close(self) -> None:
        """Stop the status thread and the server; write the final status.json."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._write_status(final=True)
        if self._server is not None:
            self._server.close()

    # -- feeds (controller threads) -----------------------------------------------------------
    def on_record(self, record: dict[str, Any]) -> None:
        """Every event-log record, after it is logged."""
        with self._lock:
            name = record.get("event")
            if name in ("abort_generation", "regroup"):
                self._gen = max(self._gen, int(record.get("gen") or 0))
            if name == "regroup":  # a roll-back: the job step goes back to where it resumes
                resume = int(record.get("resume_step") or 0)
                self._job_step = min(self._job_step, resume)
                self._rank_steps = {r: min(s, resume) for r, s in self._rank_steps.items()}
                self._recount()
            elif name == "attempt_started":
                self._rank_steps, self._job_step = {}, -1
                self._recount()
            fault = self._note_fault(record)
        self.metrics.observe(record, self.events.records)
        if fault:
            self._rewrite(goodput=False)  # the fault is in status.json before anyone acts on it

    def on_step(self, rank: int, step: int, metrics: dict[str, Any]) -> None:
        """A rank completed ``step`` steps; logs a ``step`` record when every rank has."""
        with self._lock:
            old = self._rank_steps.get(rank)
            self._rank_steps[rank] = step
            self._rank_metrics[rank] = metrics
            was_behind = old is None or old <= self._job_step
            self._behind += (step <= self._job_step) - was_behind  # O(1) per report, not a min over N
            if self._behind > 0:
                return
            self._job_step = min(self._rank_steps.values())  # once per job step: every rank is past the last one
            self._recount()
            ms = list(self._rank_metrics.values())
            fields = {"step": self._job_step, "step_s": round(max(float(m.get("step_s") or 0.0) for m in ms), 6),
                      "ckpt_s": round(max(float(m.get("ckpt_s") or 0.0) for m in ms), 6)}
            if any("shm_bytes" in m for m in ms):
                fields["shm_bytes"] = sum(int(m.get("shm_bytes") or 0) for m in ms)
        self.events.emit("step", **fields)

    def on_job_step(self, step: int, fields: dict[str, Any]) -> None:
        """Every rank completed ``step`` steps, as the nodes' summaries say (setting node_summaries: ranks'
        own reports come only around faults): a ``step`` record, at most one per summary, not one per step."""
        with self._lock:
            if step <= self._job_step:
                return
            self._job_step = step
            self._recount()
        self.events.emit("step", step=step, **{k: round(float(v), 6) for k, v in fields.items()})

    def _recount(self) -> None:
        """``_behind`` from scratch (under the lock): after a job step, a roll-back, a new attempt."""
        self._behind = self.world_size - sum(1 for s in self._rank_steps.values() if s > self._job_step)

    def _note_fault(self, r: dict[str, Any]) -> bool:
        """Keep a rank's last fault; True when ``r`` is one."""
        name, rank = r.get("event"), r.get("rank")
        if rank is None:
            return False
        if name in _FAULTS:
            what = _FAULTS[name]
        elif name == "rank_exited" and (r.get("signal") or r.get("exit_code") not in (0, None)):
            what = f"signal {r['signal']}" if r.get("signal") else f"exit {r.get('exit_code')}"
        else:
            return False
        self._last_fault[rank] = f"{what} at step {r.get('step')} ({time.strftime('%H:%M:%S', time.localtime(r['t']))})"
        return True

    # -- views -------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """The live rank table and the job's counters (what status.json and /status.json hold)."""
        snap = self._snapshot()
        with self._lock:
            faults, gen, job_step = dict(self._last_fault), self._gen, self._job_step
        ranks = []
        for w in snap["workers"]:
            m = w.get("metrics") or {}
            ranks.append({"rank": w["rank"], "pid": w["pid"], "state": w["state"], "step": w["step"],
                          "phase": w["phase"], "step_s": m.get("step_s"), "loss": m.get("loss"),
                          "last_fault": faults.get(w["rank"], ""), "generation": gen})
        alive = sum(1 for r in ranks if r["state"] in ("starting", "running"))
        self.metrics.ranks_alive.set(alive)
        return {"job_id": self.job_id, "run_dir": str(self.run_dir), "pid": os.getpid(), "updated_t": time.time(),
                "phase": snap["phase"], "attempt": snap["attempt"], "restarts_used": snap["restarts_used"],
                "generation": gen, "job_step": max(job_step, 0), "median_step_s": snap["median_step_s"],
                "world_size": self.world_size, "ranks_alive": alive, "metrics_address": self.address,
                "goodput": round(self._goodput_ratio, 4), "ranks": ranks}

    def timeline_events(self) -> list[dict[str, Any]]:
        return self.events.records()

    # -- the status thread ----------------------------------------------------------------------
    def _status_loop(self) -> None:
        while not self._stop.wait(STATUS_INTERVAL_S):
            self._rewrite()

    def _rewrite(self, goodput: bool = True) -> None:
        try:
            self._write_status(goodput=goodput)
        except Exception as exc:  # noqa: BLE001  (a status write must never stop the job)
            log.warning("status: could not write %s: %s", self.run_dir / STATUS_FILE, exc)

    def _update_goodput(self, force: bool = False) -> None:
        now = time.time()
        if force or now - self._goodput_t >= max(GOODPUT_INTERVAL_S, self._goodput_cost_s / GOODPUT_CPU_SHARE):
            self._goodput_t = now
            began = time.thread_time()
            self._goodput_ratio = goodput.breakdown(self.events.records(), now_t=now).goodput
            self._goodput_cost_s = time.thread_time() - began
            self.metrics.goodput.set(self._goodput_ratio)

    def _write_status(self, final: bool = False, goodput: bool = True) -> None:
        """Rewrite status.json (``goodput``: refresh the ratio first, every GOODPUT_INTERVAL_S)."""
        if goodput:
            self._update_goodput(force=final)
        with self._lock:  # taken before the status is: a later seq has seen every fault an earlier one saw
            self._status_seq += 1
            seq = self._status_seq
        status = self.status()
        status["final"] = final
        path = self.run_dir / STATUS_FILE
        tmp = path.with_name(f".{STATUS_FILE}.{os.getpid()}.tmp")
        with self._write_lock:
            if seq < self._written_seq or self._final_written:
                return  # a newer status (or the final one) is already there
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps(status, default=str))  # (dumps: C's encoder; dump's is Python's, 10x slower)
            os.replace(tmp, path)
            self._written_seq, self._final_written = seq, final
