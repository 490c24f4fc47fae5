"""The job's event log: every fault, decision and action, as JSON lines in the run directory.

Owned by the controller; thread-safe. Each record is ``{"t": unix seconds, "event": name,
...fields}``. Status, the demo summary and tests read the log (or :meth:`records`).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

EVENTS_FILE = "events.jsonl"


class EventLog:
    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.path = Path(run_dir) / EVENTS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._file = os.fdopen(fd, "a", encoding="utf-8")
        self._lock = threading.Lock()
        self._records: list[dict[str, Any]] = []
        # Called with each record after it is logged, in the emitting thread (the live monitor).
        self.listeners: list[Callable[[dict[str, Any]], None]] = []

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"t": round(time.time(), 6), "event": event, **fields}
        line = json.dumps(record, default=str, sort_keys=False)
        with self._lock:
            self._records.append(record)
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


def read_events(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of a run directory's event log (for tools and tests)."""
    path = Path(run_dir) / EVENTS_FILE
    if not path.exists():
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
