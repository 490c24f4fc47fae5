"""status.json follows a fault at once: `unbroken status RUN_DIR` right after a fault shows it.

A real LiveView (its status thread running) over a real EventLog, fed as the controller
feeds it; the controller's snapshot is a fixed table. The periodic rewrite (every
STATUS_INTERVAL_S) alone left the file up to a second behind a recovery that takes less.
"""

from __future__ import annotations

import json
import time

from unbroken.cli.ops import live_status
from unbroken.controller.eventlog import EventLog
from unbroken.ops.live_view import GOODPUT_CPU_SHARE, GOODPUT_INTERVAL_S, STATUS_FILE, STATUS_INTERVAL_S, LiveView

WORLD = 4


def _snapshot() -> dict:
    return {"phase": "running", "attempt": 0, "restarts_used": 0, "median_step_s": 0.05,
            "workers": [{"rank": r, "pid": 1000 + r, "step": 12, "phase": "compute", "state": "running",
                         "metrics": {"loss": 1.0, "step_s": 0.05}} for r in range(WORLD)]}


def _monitor(tmp_path) -> tuple[EventLog, LiveView]:
    events = EventLog(tmp_path)
    monitor = LiveView(run_dir=tmp_path, job_id="statustest", world_size=WORLD, events=events,
                         snapshot=_snapshot)
    events.listeners.append(monitor.on_record)
    return events, monitor


def _faults(tmp_path) -> dict[int, str]:
    status = json.loads((tmp_path / STATUS_FILE).read_text())
    return {r["rank"]: r["last_fault"] for r in status["ranks"]}


def test_a_recorded_fault_is_in_status_json_before_emit_returns(tmp_path):
    events, monitor = _monitor(tmp_path)
    monitor.start()
    try:
        deadline = time.monotonic() + 10 * STATUS_INTERVAL_S
        while not (tmp_path / STATUS_FILE).exists():  # the status thread's first periodic write
            assert time.monotonic() < deadline, "the status thread never wrote status.json"
            time.sleep(0.02)
        assert _faults(tmp_path)[2] == ""
        events.emit("rank_exited", rank=2, pid=1002, attempt=0, exit_code=None, signal=9, step=12)
        assert _faults(tmp_path)[2].startswith("signal 9 at step 12 ("), _faults(tmp_path)
        live = live_status(str(tmp_path), None)  # what `unbroken status RUN_DIR` reads
        assert live is not None and "signal 9 at step 12" in live["ranks"][2]["last_fault"]
        events.emit("rank_exited", rank=1, pid=1001, attempt=0, exit_code=0, signal=None, step=12)
        events.emit("hang_detected", rank=3, step=12, phase="compute")
        faults = _faults(tmp_path)
        assert faults[1] == "" and faults[3].startswith("hang at step 12 (") and faults[2].startswith("signal 9")
    finally:
        monitor.close()
        events.close()


def test_a_fault_recorded_after_close_does_not_replace_the_final_status(tmp_path):
    events, monitor = _monitor(tmp_path)
    monitor.start()
    monitor.close()
    final = (tmp_path / STATUS_FILE).read_text()
    assert json.loads(final)["final"] is True
    events.emit("rank_exited", rank=2, pid=1002, attempt=0, exit_code=1, signal=None, step=12)
    events.close()
    assert (tmp_path / STATUS_FILE).read_text() == final
    assert live_status(str(tmp_path), None) is None  # a finished job: `unbroken status` gives the summary


def test_step_records_come_when_every_rank_is_past_a_step_whatever_the_order(tmp_path):
    """The job step is the slowest rank's, kept with a count (not a min over every rank per report):
    random report orders, a rank going back (a roll-back's regroup) and a new attempt give the
    records the min over ranks gives."""
    import random

    rng = random.Random(3)
    events, monitor = _monitor(tmp_path)  # not started: records only
    try:
        steps, job_step, want = {}, -1, []
        for round_ in range(60):
            if round_ in (20, 40):  # a roll-back to step 3, then a new attempt
                resume = 3
                if round_ == 20:
                    events.emit("regroup", gen=1, resume_step=resume)
                    steps = {r: min(s, resume) for r, s in steps.items()}
                    job_step = min(job_step, resume)
                else:
                    events.emit("attempt_started", attempt=1)
                    steps, job_step = {}, -1
            rank = rng.randrange(WORLD)
            step = steps.get(rank, 0) + rng.choice((1, 1, 2))
            steps[rank] = step
            monitor.on_step(rank, step, {"step_s": 0.01})
            if len(steps) == WORLD and min(steps.values()) > job_step:
                job_step = min(steps.values())
                want.append(job_step)
        got = [r["step"] for r in events.records("step")]
        assert got == want and len(want) > 5
    finally:
        events.close()


def test_the_live_goodput_takes_a_bounded_share_of_the_status_thread_however_long_the_job(tmp_path):
    """Each live goodput reads every record since the start (one per job step): once a read took long,
    the next waits long enough that the reads stay within GOODPUT_CPU_SHARE of the thread."""
    events, monitor = _monitor(tmp_path)
    try:
        for step in range(2_000):
            events.emit("step", step=step, step_s=0.1, ckpt_s=0.0)
        reads = []
        real = monitor.events.records
        monitor.events.records = lambda: reads.append(1) or real()  # (an instance attribute: this log only)
        monitor._update_goodput(force=True)
        assert len(reads) == 1 and monitor._goodput_cost_s >= 0
        monitor._goodput_cost_s = 1.0  # as if that read took a second of CPU (a job of millions of steps)
        wait_s = 1.0 / GOODPUT_CPU_SHARE
        assert wait_s > 2 * GOODPUT_INTERVAL_S
        monitor._goodput_t = time.time() - 2 * GOODPUT_INTERVAL_S  # past the interval, not past the share
        monitor._update_goodput()
        assert len(reads) == 1, "the goodput was read again before its share of the thread allowed"
        monitor._goodput_t = time.time() - wait_s - 1
        monitor._update_goodput()
        assert len(reads) == 2
    finally:
        monitor.close()
        events.close()
