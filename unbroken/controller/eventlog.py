"""The job's event log: every fault, decision and action, as JSON lines in the run directory.

Owned by the controller; thread-safe. Each record is ``{"t": unix seconds, "event": name,
...fields}``. Status, the demo summary and tests read the log (or :meth:`records`).

In memory, old ``step`` records (one per job step) are merged in runs: a merged record stands for
``steps`` consecutive job steps, at the last one's time and index, its ``step_s`` and ``ckpt_s``
their sums (so the goodput's productive and checkpoint seconds stay what they were); the first
step record after any other record stays as it is.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

EVENTS_FILE = "events.jsonl"
#: In memory (:meth:`EventLog.records`), the newest step records are kept as they are; older runs of
#: them are merged, up to MERGE_STEPS steps a record, so that a job of millions of steps holds
#: thousands of records, not millions (~1 kB each). The file keeps every record.
KEEP_STEP_RECORDS = 20_000
MERGE_STEPS = 1_000


class EventLog:
    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.path = Path(run_dir) / EVENTS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._file = os.fdopen(fd, "a", encoding="utf-8")
        self._lock = threading.Lock()
        self._records: list[dict[str, Any]] = []
        self._step_records = 0  # "step" records in _records
        # Called with each record after it is logged, in the emitting thread (the live monitor).
        self.listeners: list[Callable[[dict[str, Any]], None]] = []

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"t": round(time.time(), 6), "event": event, **fields}
        line = json.dumps(record, default=str, sort_keys=False)
        with self._lock:
            self._records.append(record)
            if event == "step":
                self._step_records += 1
                if self._step_records > 2 * KEEP_STEP_RECORDS:
                    self._merge_old_steps_locked()
            if not self._file.closed:
                self._file.write(line + "\n")
                self._file.flush()
        for listener in self.listeners:
            listener(record)
        return record

    def records(self, event: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            return [r for r in self._records if event is None or r["event"] == event]

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def _merge_old_steps_locked(self) -> None:
        """Merge the step records before the newest KEEP_STEP_RECORDS (see the module docstring)."""
        keep_from, newest = len(self._records), 0
        while newest < KEEP_STEP_RECORDS:
            keep_from -= 1
            newest += self._records[keep_from]["event"] == "step"
        merged: list[dict[str, Any]] = []
        for r in self._records[:keep_from]:
            last = merged[-1] if merged else None
            if (r["event"] == "step" and last is not None and last["event"] == "step" and len(merged) > 1
                    and merged[-2]["event"] == "step" and last.get("steps", 1) + r.get("steps", 1) <= MERGE_STEPS):
                merged[-1] = _merged(last, r)  # (never into a run's first record)
            else:
                merged.append(r)
        self._records[:keep_from] = merged
        self._step_records = sum(1 for r in self._records if r["event"] == "step")


def _merged(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Step records ``a`` then ``b`` as one (see the module docstring)."""
    out = {**b, "steps": a.get("steps", 1) + b.get("steps", 1)}
    for name in ("step_s", "ckpt_s"):
        out[name] = round(float(a.get(name) or 0.0) + float(b.get(name) or 0.0), 6)
    return out


def read_events(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of a run directory's event log (for tools and tests)."""
    path = Path(run_dir) / EVENTS_FILE
    if not path.exists():
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
