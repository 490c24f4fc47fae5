"""`unbroken status` and `unbroken report`: a job's live rank table, its summary, its goodput.

* ``unbroken status RUN_DIR``: a live job's rank table (from ``RUN_DIR/status.json``, which
  the controller rewrites every second), or a finished job's summary (from ``events.jsonl``);
  ``--address HOST:PORT`` asks a live job's metrics port instead; ``--json`` for scripts.
* ``unbroken report RUN_DIR``: where the wall time went (goodput and badput by cause) and
  every recovery's phases; ``--plot out.png`` draws the timeline (matplotlib, extra ``[plot]``).
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from unbroken.controller.eventlog import EVENTS_FILE, read_events
from unbroken.errors import ConfigError, UnbrokenError
from unbroken.ops import goodput
from unbroken.ops.live_view import STATUS_FILE

LIVE_WITHIN_S = 10.0  # a status.json rewritten this recently belongs to a running job


def add_ops_commands(sub: Any) -> None:
    status = sub.add_parser("status", help="a job's live rank table, or a finished job's summary")
    status.add_argument("run_dir", nargs="?", default=None, help="the job's run directory")
    status.add_argument("--address", default=None, metavar="HOST:PORT", help="a live job's --metrics-port")
    status.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    report = sub.add_parser("report", help="where a run's time went: goodput, badput by cause, recoveries")
    report.add_argument("run_dir", help="the run directory (holds events.jsonl)")
    report.add_argument("--plot", default=None, metavar="OUT.png", help="draw the timeline into a PNG")
    report.add_argument("--json", action="store_true", help="print JSON (for scripts)")


def _events(run_dir: str) -> list[dict[str, Any]]:
    path = Path(run_dir) / EVENTS_FILE
    if not path.is_file():
        raise ConfigError(f"{path} not found: give the run directory of a job (`unbroken run --run-dir DIR`)")
    return read_events(run_dir)


def live_status(run_dir: str | None, address: str | None) -> dict[str, Any] | None:
    """A running job's status (None when the job in ``run_dir`` is not running)."""
    if address:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"--address {address!r} must be HOST:PORT (the job's --metrics-port)")
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/status.json", timeout=5) as resp:
                return json.loads(resp.read())
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise UnbrokenError(f"no job answers on {address}: {exc} (is it running with --metrics-port?)") from exc
    path = Path(run_dir) / STATUS_FILE
    try:
        status = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if status.get("final") or time.time() - float(status.get("updated_t", 0)) > LIVE_WITHIN_S:
        return None
    return status


def summary(events: list[dict[str, Any]]) -> dict[str, Any]:
    """A finished (or stopped) job's summary from its event log."""
    bd = goodput.breakdown(events)
    finished = next((e for e in events if e["event"] == "job_finished"), None)
    steps = [e["step"] for e in events if e["event"] == "step"]
    return {"state": "finished" if finished else "not running (no job_finished record: killed?)",
            "exit_code": finished.get("exit_code") if finished else None,
            "reason": finished.get("reason") if finished else "",
            "wall_s": round(bd.wall_s, 3), "steps": max(steps, default=0), "goodput": round(bd.goodput, 4),
            "faults": sum(1 for e in events if e["event"] == "decision"),
            "recoveries": bd.to_json()["recoveries"]}


def _rank_table(status: dict[str, Any]) -> Table:
    table = Table(title=f"job {status['job_id']}: {status['phase']}, step {status['job_step']}, attempt "
                        f"{status['attempt']}, generation {status['generation']}, goodput "
                        f"{100 * status['goodput']:.1f}%")
    for col in ("rank", "pid", "state", "step", "phase", "step s", "loss", "generation", "last fault"):
        table.add_column(col)
    for r in status["ranks"]:
        table.add_row(*(("-" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v) or "-") for v in (
            r["rank"], r["pid"], r["state"], r["step"], r["phase"], r["step_s"], r["loss"], r["generation"],
            r["last_fault"])))
    return table


def cmd_status(args: argparse.Namespace) -> int:
    if not args.run_dir and not args.address:
        raise ConfigError("unbroken status: give a RUN_DIR or --address HOST:PORT")
    console = Console(width=150, markup=False)  # prints run dirs, reasons, faults: never markup
    status = live_status(args.run_dir, args.address)
    if status is not None:
        if args.json:
            print(json.dumps(status, default=str))
        else:
            console.print(_rank_table(status))
        return 0
    s = summary(_events(args.run_dir))
    if args.json:
        print(json.dumps(s, default=str))
        return 0
    console.print(f"job {s['state']}: exit {s['exit_code']} ({s['reason']}), {s['steps']} steps in "
                  f"{s['wall_s']:.1f} s, {s['faults']} fault(s), goodput {100 * s['goodput']:.1f}%")
    for r in s["recoveries"]:
        console.print(f"  rank {r['rank']} {r['kind']} at step {r['step']}: {r['rung']}, "
                      + ", ".join(f"{p} {r[p + '_s']:.2f} s" for p in goodput.PHASES)
                      + f", {r['steps_redone']} step(s) redone")
    return 0


def goodput_table(bd: goodput.Breakdown) -> Table:
    table = Table(title=f"where the time went: {bd.wall_s:.2f} s wall, goodput {100 * bd.goodput:.1f}%, "
                        f"{bd.steps} steps")
    for col in ("category", "seconds", "share", "ml-goodput-measurement"):
        table.add_column(col, justify="right" if col in ("seconds", "share") else "left")
    for row in bd.rows():
        table.add_row(row["what"], f"{row['seconds']:.3f}", f"{100 * row['share']:.1f}%", row["ml_goodput"])
    table.add_row("total", f"{sum(bd.seconds.values()):.3f}", "100.0%", "")
    return table


def cmd_report(args: argparse.Namespace) -> int:
    events = _events(args.run_dir)
    bd = goodput.breakdown(events)
    console = Console(width=150, markup=False)  # prints run dirs, reasons, faults: never markup
    if args.json:
        print(json.dumps(bd.to_json()))
    else:
        console.print(goodput_table(bd))
        for r in bd.to_json()["recoveries"]:
            console.print(f"  recovery: rank {r['rank']} {r['kind']} at step {r['step']} -> {r['rung']}: "
                          + ", ".join(f"{p} {r[p + '_s']:.2f} s" for p in goodput.PHASES))
    if args.plot:
        from unbroken.ops.plot import write_png

        write_png(events, args.plot, title=f"{Path(args.run_dir).name}: step progress per rank")
        if not args.json:
            console.print(f"timeline written to {args.plot}")
    return 0
