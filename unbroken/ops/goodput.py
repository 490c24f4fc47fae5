"""Where a job's wall time went, from its event log: productive steps and badput by cause.

Pure functions over event-log records (``events.jsonl``); no I/O, no threads. Used by
``unbroken report``, the timeline picture, the live page and the ``unbroken_goodput_ratio``
metric.

The wall time (first record to ``job_finished``, or to ``now`` for a live job) is cut into
labelled intervals; where two overlap the more specific one wins (a recovery phase over the
steps it interrupted, a checkpoint stall over the step it ended), and time nobody claims is
``idle``. So the rows add up to the wall time by construction.

The categories, and the ml-goodput-measurement badput type each maps to:

============  ==========================================  =================================
category      what                                        ml-goodput-measurement
============  ==========================================  =================================
productive    steps that counted                          (goodput)
startup       launch to the first step (imports, groups)  PROGRAM_STARTUP
checkpoint    steps blocked by their checkpoint           UNPRODUCTIVE_CHECKPOINT_SAVE_TIME
detect        a fault began -> the controller decided     INFRASTRUCTURE_RECOVERY_...
replace       a process replaced / the job restarted      INFRASTRUCTURE_RECOVERY_...
regroup       the next process group built                INFRASTRUCTURE_RECOVERY_...
restore       state from replicas or a checkpoint         UNPRODUCTIVE_CHECKPOINT_RESTORE_..
redo          the step in flight lost, steps redone       WASTED_PROGRESS_FROM_DISRUPTION
idle          anything else (end of job, gaps)            OTHER
============  ==========================================  =================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

Record = dict[str, Any]

CATEGORIES = ("productive", "startup", "checkpoint", "detect", "replace", "regroup", "restore", "redo", "idle")
PHASES = ("detect", "replace", "regroup", "restore", "redo")  # of one recovery, in order
ML_GOODPUT = {"productive": "GOODPUT", "startup": "PROGRAM_STARTUP",
              "checkpoint": "UNPRODUCTIVE_CHECKPOINT_SAVE_TIME",
              "detect": "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION",
              "replace": "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION",
              "regroup": "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION",
              "restore": "UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME",
              "redo": "WASTED_PROGRESS_FROM_DISRUPTION", "idle": "OTHER"}
DESCRIPTIONS = {"productive": "productive steps", "startup": "start-up (launch to first step)",
                "checkpoint": "checkpoint stall", "detect": "recovery: fault detection",
                "replace": "recovery: replace / restart", "regroup": "recovery: regroup",
                "restore": "recovery: restore state", "redo": "redone steps (step in flight lost, redo)",
                "idle": "idle (end of job, other)"}
# Higher wins where intervals overlap.
_PRIORITY = {"idle": 0, "startup": 1, "productive": 2, "checkpoint": 3, "redo": 4,
             "detect": 5, "replace": 5, "regroup": 5, "restore": 5}


@dataclass(frozen=True)
class Recovery:
    """One fault and its recovery, with wall-clock phase intervals ``(phase, start_t, end_t)``."""

    fault_t: float
    end_t: float
    rung: str
    kind: str
    rank: int | None
    step: int | None
    phases: tuple[tuple[str, float, float], ...]
    lost_from_t: float  # the step in flight began: its work up to fault_t is lost
    steps_redone: int = 0

    def seconds(self, phase: str) -> float:
        return sum(b - a for p, a, b in self.phases if p == phase)


@dataclass
class Breakdown:
    """Seconds per category over ``[start_t, end_t]`` (they add up to ``wall_s``)."""

    start_t: float
    end_t: float
    seconds: dict[str, float] = field(default_factory=dict)
    intervals: list[tuple[str, float, float]] = field(default_factory=list)
    steps: int = 0
    recoveries: list[Recovery] = field(default_factory=list)

    @property
    def wall_s(self) -> float:
        return self.end_t - self.start_t

    @property
    def goodput(self) -> float:
        return self.seconds.get("productive", 0.0) / self.wall_s if self.wall_s > 0 else 0.0

    def rows(self) -> list[dict[str, Any]]:
        return [{"category": c, "what": DESCRIPTIONS[c], "seconds": round(self.seconds.get(c, 0.0), 4),
                 "share": round(self.seconds.get(c, 0.0) / self.wall_s, 4) if self.wall_s > 0 else 0.0,
                 "ml_goodput": ML_GOODPUT[c]} for c in CATEGORIES]

    def to_json(self) -> dict[str, Any]:
        return {"wall_s": round(self.wall_s, 4), "goodput": round(self.goodput, 4), "steps": self.steps,
                "rows": self.rows(), "recoveries": [
                    {"rank": r.rank, "kind": r.kind, "rung": r.rung, "step": r.step, "steps_redone": r.steps_redone,
                     **{f"{p}_s": round(r.seconds(p), 4) for p in PHASES}} for r in self.recoveries]}


def _first(events: list[Record], name: str, after_t: float, before_t: float) -> Record | None:
    return next((e for e in events if e["event"] == name and after_t <= e["t"] <= before_t), None)


def _last(events: list[Record], name: str, after_t: float, before_t: float) -> Record | None:
    found = [e for e in events if e["event"] == name and after_t <= e["t"] <= before_t]
    return found[-1] if found else None


def _in_flight_phases(fault_t: float, f: Record) -> list[tuple[str, float, float]]:
    """detect/replace/regroup as the controller timed them; restore: the rest up to the resume."""
    out, t = [], fault_t
    for phase in ("detect", "replace", "regroup"):
        seconds = max(0.0, min(float(f.get(f"{phase}_s") or 0.0), f["t"] - t))
        out.append((phase, t, t + seconds))
        t += seconds
    out.append(("restore", t, f["t"]))
    return out


def _restart_phases(events: list[Record], fault_t: float, decided_t: float, end_t: float,
                    attempt: int | None) -> list[tuple[str, float, float]]:
    """A job restart: replace = stop, start and rendezvous again; restore = the checkpoint load."""
    restored = [e for e in events if e["event"] == "restored" and decided_t <= e["t"] <= end_t
                and (attempt is None or e.get("attempt") == attempt)]
    if not restored:
        return [("detect", fault_t, decided_t), ("replace", decided_t, end_t)]
    done_t = max(e["t"] for e in restored)
    begin_t = max(decided_t, min(done_t - float(max(e.get("seconds") or 0.0 for e in restored)), done_t))
    return [("detect", fault_t, decided_t), ("replace", decided_t, begin_t), ("restore", begin_t, done_t),
            ("redo", done_t, end_t)]


def recoveries(events: list[Record]) -> list[Recovery]:
    """Every recovery the log shows as finished (a ``recovered`` record), with its phases."""
    out: list[Recovery] = []
    steps = [e for e in events if e["event"] == "step"]
    for rec in (e for e in events if e["event"] == "recovered"):
        fault_t = rec["t"] - float(rec.get("recover_s") or 0.0)
        decision = _first(events, "decision", fault_t - 1e-3, rec["t"])
        decided_t = min(max(decision["t"], fault_t), rec["t"]) if decision else fault_t
        flight = _last(events, "recovered_in_flight", fault_t, rec["t"])
        if flight is not None and rec.get("tier") == "replicas":
            phases = _in_flight_phases(fault_t, flight) + [("redo", flight["t"], rec["t"])]
            redone = int(flight.get("steps_redone") or 0)
        else:
            phases = _restart_phases(events, fault_t, decided_t, rec["t"], rec.get("attempt"))
            redone = max(0, int(rec.get("step") or 0) - int(rec.get("restored_step") or 0))
        before = [s["t"] for s in steps if s["t"] <= fault_t]
        out.append(Recovery(fault_t=fault_t, end_t=rec["t"], rung=decision["rung"] if decision else "?",
                            kind=decision.get("kind", "?") if decision else "?",
                            rank=decision.get("rank") if decision else None, step=rec.get("step"),
                            phases=tuple(phases), lost_from_t=max(before) if before else fault_t,
                            steps_redone=redone))
    return out


def _step_intervals(steps: list[Record]) -> list[tuple[str, float, float]]:
    """Each job step from the previous one's end (or its own start): productive, then its checkpoint."""
    out, prev_t = [], None
    for s in steps:
        own_s = float(s.get("step_s") or 0.0) + float(s.get("ckpt_s") or 0.0)
        start = s["t"] - own_s if prev_t is None or s["t"] - prev_t > 10 * max(own_s, 1e-3) else prev_t
        ckpt_from = max(start, s["t"] - float(s.get("ckpt_s") or 0.0))
        out += [("productive", start, ckpt_from), ("checkpoint", ckpt_from, s["t"])]
        prev_t = s["t"]
    return out


def _paint(intervals: Iterable[tuple[str, float, float]], start_t: float, end_t: float
           ) -> list[tuple[str, float, float]]:
    """Flatten overlapping labelled intervals: each piece of time gets the highest-priority
    label covering it (a sweep over the interval ends: O(n log n))."""
    marks: list[tuple[float, int, str]] = []
    for c, a, b in intervals:
        a, b = max(a, start_t), min(b, end_t)
        if b > a:
            marks += [(a, 1, c), (b, -1, c)]
    marks.sort(key=lambda m: m[0])
    active = {c: 0 for c in _PRIORITY}
    out: list[tuple[str, float, float]] = []
    t, i = start_t, 0
    while t < end_t:
        while i < len(marks) and marks[i][0] <= t:
            active[marks[i][2]] += marks[i][1]
            i += 1
        nxt = marks[i][0] if i < len(marks) else end_t
        label = max((c for c, n in active.items() if n > 0), key=_PRIORITY.__getitem__, default="idle")
        if out and out[-1][0] == label:
            out[-1] = (label, out[-1][1], nxt)
        else:
            out.append((label, t, nxt))
        t = nxt
    return out


def breakdown(events: list[Record], now_t: float | None = None) -> Breakdown:
    """The goodput breakdown of a run's records (``now_t``: the end of a live job's window)."""
    if not events:
        return Breakdown(0.0, 0.0)
    start_t = events[0]["t"]
    finished = next((e for e in events if e["event"] == "job_finished"), None)
    end_t = finished["t"] if finished else max(now_t or 0.0, events[-1]["t"])
    steps = [e for e in events if e["event"] == "step"]
    recs = recoveries(events)
    labelled = _step_intervals(steps)
    first_step = labelled[0][1] if labelled else end_t
    labelled.append(("startup", start_t, first_step))
    for r in recs:
        labelled.append(("redo", r.lost_from_t, r.fault_t))
        labelled += list(r.phases)
    painted = _paint(labelled, start_t, end_t)
    seconds = {c: 0.0 for c in CATEGORIES}
    for c, a, b in painted:
        seconds[c] += b - a
    return Breakdown(start_t, end_t, seconds, painted, steps=sum(s.get("steps", 1) for s in steps), recoveries=recs)
