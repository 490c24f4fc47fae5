"""What happened when: the timeline of a run, from its event log, for the picture and the page.

Pure: :func:`build` turns event-log records into a :class:`Timeline` (seconds since the
job started): the job's step progress, each rank's step progress and state over time
(starting, running, paused, hung, down, finished), every fault and decision as a marker,
and the goodput intervals (recovery phases, checkpoint stalls, ...). :mod:`unbroken.ops.plot`
draws it with matplotlib, :mod:`unbroken.ops.web` as SVG.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from unbroken.ops import goodput

Record = dict[str, Any]

STATE_COLORS = {"starting": "#bdbdbd", "running": "#4caf50", "paused": "#ffca28", "hung": "#ff7043",
                "down": "#e53935", "finished": "#90a4ae"}
CATEGORY_COLORS = {"productive": "#4caf50", "startup": "#9e9e9e", "checkpoint": "#7e57c2", "detect": "#ff7043",
                   "replace": "#e53935", "regroup": "#ffca28", "restore": "#42a5f5", "redo": "#8d6e63",
                   "idle": "#eeeeee"}
_DETECTED = {"hang_detected": "hang", "memory_fault": "memory fault", "non_finite": "NaN/Inf",
             "sdc_detected": "silent corruption", "sub_health": "degraded", "agent_lost": "node lost"}


@dataclass(frozen=True)
class Marker:
    t: float
    kind: str  # "fault" | "decision" | "recovered"
    label: str
    rank: int | None = None


@dataclass
class Timeline:
    """A run in seconds since its first record (``wall_s`` long)."""

    wall_s: float
    world_size: int
    job_steps: list[tuple[float, int]] = field(default_factory=list)
    rank_steps: dict[int, list[tuple[float, int | None]]] = field(default_factory=dict)  # None: a gap
    rank_states: dict[int, list[tuple[str, float, float]]] = field(default_factory=dict)
    markers: list[Marker] = field(default_factory=list)
    intervals: list[tuple[str, float, float]] = field(default_factory=list)  # goodput categories
    breakdown: goodput.Breakdown | None = None


def _fault_label(e: Record) -> str | None:
    if e["event"] in _DETECTED:
        return f"{_DETECTED[e['event']]} r{e.get('rank')}"
    if e["event"] == "rank_exited" and (e.get("signal") or e.get("exit_code") not in (0, None)):
        how = f"signal {e['signal']}" if e.get("signal") else f"exit {e.get('exit_code')}"
        return f"{'kill' if e.get('signal') == 9 else how} r{e.get('rank')}"
    return None


class _Lanes:
    """Each rank's state over time, from the per-rank records in time order."""

    def __init__(self, world_size: int) -> None:
        self.state = {r: ("starting", 0.0) for r in range(world_size)}
        self.out: dict[int, list[tuple[str, float, float]]] = {r: [] for r in range(world_size)}
        self.killed: set[int] = set()

    def go(self, rank: int, state: str, t: float) -> None:
        if rank not in self.state:
            return
        old, since = self.state[rank]
        if old == state:
            return
        if t > since:
            self.out[rank].append((old, since, t))
        self.state[rank] = (state, t)

    def end(self, t: float) -> None:
        for rank, (state, since) in self.state.items():
            if t > since:
                self.out[rank].append((state, since, t))

    def on(self, e: Record, t: float) -> None:
        name, rank = e["event"], e.get("rank")
        if name == "rank_started":
            self.go(rank, "starting", t)
        elif name == "rank_paused":
            self.go(rank, "paused", t)
        elif name == "rank_resumed":
            self.go(rank, "running", t)
        elif name == "hang_detected":
            self.go(rank, "hung", t - float(e.get("silent_s") or 0.0))
        elif name == "rank_exited":
            self.go(rank, "finished" if e.get("exit_code") == 0 and not e.get("signal") else "down", t)
        elif name == "step":
            for r, (state, _) in self.state.items():
                if state == "starting":
                    self.go(r, "running", t - float(e.get("step_s") or 0.0))


def build(events: list[Record], now_t: float | None = None) -> Timeline:
    """The timeline of a run's records (``now_t``: the end of a live job's window)."""
    if not events:
        return Timeline(0.0, 0)
    t0 = events[0]["t"]
    started = next((e for e in events if e["event"] == "controller_started"), {})
    world = int(started.get("world_size") or 1 + max((e.get("rank") or 0) for e in events))
    bd = goodput.breakdown(events, now_t=now_t)
    tl = Timeline(wall_s=bd.wall_s, world_size=world, breakdown=bd,
                  intervals=[(c, a - t0, b - t0) for c, a, b in bd.intervals])
    lanes = _Lanes(world)
    steps: dict[int, int] = {}
    tl.rank_steps = {r: [] for r in range(world)}
    for e in events:
        t = e["t"] - t0
        lanes.on(e, t)
        if e["event"] == "step":
            tl.job_steps.append((t, e["step"]))
            for r in range(world):
                state = lanes.state[r][0]
                tl.rank_steps[r].append((t, e["step"] if state == "running" else None))
        elif e.get("rank") is not None and e["event"] in ("rank_paused", "rank_resumed", "rank_exited") \
                and e.get("step") is not None and e["rank"] in tl.rank_steps:
            tl.rank_steps[e["rank"]].append((t, e["step"]))
            steps[e["rank"]] = e["step"]
        label = _fault_label(e)
        if label and not (e["event"] == "rank_exited" and e.get("rank") in lanes.killed):
            tl.markers.append(Marker(t, "fault", label, e.get("rank")))
        if e["event"] == "kill_rank":
            lanes.killed.add(e.get("rank"))
        elif e["event"] == "decision":
            tl.markers.append(Marker(t, "decision", str(e.get("rung")), e.get("rank")))
    lanes.end(tl.wall_s)
    tl.rank_states = lanes.out
    return tl
