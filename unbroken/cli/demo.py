"""`unbroken demo`: the example GPT on 4 ranks survives a crash, a memory fault, a NaN loss and a hang.

Two runs of the same job under the launcher: a fault-free reference, then one with a
SIGKILL, a corruption of optimizer state and a NaN loss (both repaired by `retry`) and a
hang injected. ``--script ddp`` runs examples/train_ddp.py instead (stock
``DistributedDataParallel``): a SIGKILL inside DDP's gradient all-reduce, a kill of rank 0 and a
hang, each recovered in flight. A live table shows each rank's step, loss and state; the
summary lists every fault, how it was recovered and how long it took, and whether the
final weights equal the reference bit for bit.
"""

from __future__ import annotations

import secrets
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from unbroken.agent import pool
from unbroken.agent.launcher import JobResult, resolve, run_job
from unbroken.config import LaunchConfig
from unbroken.controller.eventlog import read_events
from unbroken.controller.server import Controller
from unbroken.recovery.policy import JobPolicy
from unbroken.worker_config import CheckpointConfig

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SCRIPTS = {"gpt": "train_gpt.py", "ddp": "train_ddp.py"}  # --script of `unbroken demo`


def fault_plan(script: str, steps: int, nproc: int) -> str:
    """The faults of the demo's faulty run for ``script`` (spread over the run's steps)."""
    kill_step, corrupt_step, hang_step = max(1, steps // 4), max(2, steps // 2), max(4, (3 * steps) // 4)
    if script == "ddp":  # what stock DDP recovers in flight (tests/integration/test_ddp_in_flight.py)
        return (f"kill:rank={min(2, nproc - 1)}:step={kill_step}:at=sync,"
                f"kill:rank=0:step={corrupt_step}:at=sync,"
                f"hang:rank={min(1, nproc - 1)}:step={hang_step}")
    nan_step = max(3, (5 * steps) // 8)
    return (f"kill:rank={min(2, nproc - 1)}:step={kill_step},"
            f"corrupt:rank={min(3, nproc - 1)}:step={corrupt_step}:what=optimizer,"
            f"nan:rank=0:step={nan_step},"
            f"hang:rank={min(1, nproc - 1)}:step={hang_step}")


def _progress_table(title: str, snap: dict[str, Any], started: float) -> Table:
    table = Table(title=f"{title}  (attempt {snap['attempt']}, {time.monotonic() - started:.1f} s)")
    for col in ("rank", "pid", "state", "step", "phase", "loss"):
        table.add_column(col)
    for w in snap["workers"]:
        loss = w["metrics"].get("loss")
        table.add_row(str(w["rank"]), str(w["pid"]), w["state"], str(w["step"] if w["step"] is not None else "-"),
                      w["phase"], f"{loss:.4f}" if isinstance(loss, float) else "-")
    median = snap["median_step_s"]
    table.caption = f"steps/s: {1 / median:.1f}" if median else "starting"
    return table


def _run(console: Console, title: str, cfg: LaunchConfig, live: bool) -> tuple[JobResult, dict[str, Any]]:
    """Run one job under the launcher with the live view; returns its result and last snapshot."""
    holder: dict[str, Controller] = {}
    stop = threading.Event()
    started = time.monotonic()

    def watch() -> None:
        if not live:
            return
        with Live(console=console, refresh_per_second=4, transient=False) as view:
            while not stop.wait(0.25):
                if "c" in holder:
                    view.update(_progress_table(title, holder["c"].snapshot(), started))

    viewer = threading.Thread(target=watch, daemon=True)
    viewer.start()
    log_path = Path(cfg.run_dir) / "workers.log"
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    with open(log_path, "w", encoding="utf-8") as out:
        try:
            result = run_job(cfg, output=out, on_controller=lambda c: holder.__setitem__("c", c))
        finally:
            stop.set()
            viewer.join()
    console.print()
    console.print(f"{title}: exit {result.exit_code} in {time.monotonic() - started:.1f} s ({escape(result.reason)})")
    return result, holder["c"].snapshot() if "c" in holder else {"workers": []}


def _weights_equal(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    wa, wb = load_file(str(a)), load_file(str(b))
    return wa.keys() == wb.keys() and all(wa[k].dtype == wb[k].dtype and bool((wa[k] == wb[k]).all())
                                          and wa[k].shape == wb[k].shape for k in wa)


_DAMAGE = {"memory_fault": "memory fault", "non_finite": "NaN/Inf gradients", "sdc_detected": "silent corruption"}


def summarize(run_dir: Path) -> list[dict[str, Any]]:
    """One row per injected fault, from the faulty run's event log: how it was seen and recovered."""
    events = read_events(run_dir)
    rows: list[dict[str, Any]] = []
    for fault in (e for e in events if e["event"] == "fault_injected"):
        after = [e for e in events if e["t"] >= fault["t"]]
        detection = next((e for e in after if e["event"] in ("hang_detected", *_DAMAGE) or
                          (e["event"] == "rank_exited" and e.get("exit_code") != 0)), None)
        decision = next((e for e in after if e["event"] == "decision"), None)
        in_flight = next((e for e in after if e["event"] == "recovered_in_flight"), None)
        in_flight_rungs = ("retry", "recover-in-place", "recover")
        recovered = next((e for e in after if e["event"] == "recovered"), None)
        rows.append({"fault": fault, "detection": detection, "decision": decision,
                     "in_flight": in_flight if decision and decision["rung"] in in_flight_rungs else None,
                     "recovered": recovered})
    return rows


def _recovery_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="faults and recoveries")
    for col in ("fault", "detected as", "strategy", "state from", "detect/replace/regroup/restore s",
                "recover_s", "redone"):
        table.add_column(col, no_wrap=True)
    for row in rows:
        d, rec, fl = row["detection"], row["recovered"], row["in_flight"]
        how = "-" if d is None else "hang (no progress)" if d["event"] == "hang_detected" else \
            _DAMAGE[d["event"]] if d["event"] in _DAMAGE else (
                f"exit, signal {d.get('signal')}" if d.get("signal") else f"exit {d.get('exit_code')}")
        parts = "-" if fl is None else "/".join(f"{fl[k]:.2f}" for k in ("detect_s", "replace_s", "regroup_s",
                                                                          "restore_s") if fl.get(k) is not None)
        table.add_row(row["fault"]["fault"], how, row["decision"]["rung"] if row["decision"] else "-",
                      f"{rec['tier']} @ step {rec['restored_step']}" if rec else "-", parts,
                      f"{rec['recover_s']:.2f}" if rec else "-",
                      str(rec["step"] - rec["restored_step"]) if rec else "-")
    return table


def _timeline(console: Console, run_dir: Path, plan: str) -> None:
    """The goodput table and the timeline picture of the faulty run (the picture needs matplotlib)."""
    from unbroken.cli.ops import goodput_table
    from unbroken.errors import ConfigError
    from unbroken.ops import goodput
    from unbroken.ops.plot import write_png

    events = read_events(run_dir)
    console.print(goodput_table(goodput.breakdown(events)))
    try:
        faults = " + ".join(f.split(":")[0] for f in plan.split(","))
        path = write_png(events, run_dir / "timeline.png", title=f"unbroken demo: {faults}; step progress per "
                         "rank, recovery phases shaded")
        console.print(escape(f"timeline picture: {path}  (again: unbroken report {run_dir} --plot out.png)"))
    except ConfigError as exc:
        console.print(escape(f"no timeline picture: {exc}"))


def run_demo(*, steps: int = 60, nproc: int = 4, run_dir: str | None = None, live: bool = True,
             script: str = "gpt") -> int:
    console = Console(width=None if sys.stdout.isatty() else 170)  # logs: no truncated columns
    root = Path(run_dir or f"runs/demo-{secrets.token_hex(3)}").absolute()
    common = dict(script=str(EXAMPLES / SCRIPTS[script]), nproc_per_node=nproc, recovery=JobPolicy(max_restarts=3),
                  omp_num_threads=1)
    args = ("--steps", str(steps), "--step-sleep-s", "0.02")
    console.rule("[bold]unbroken demo")
    console.print(f"{nproc} ranks, example GPT ({SCRIPTS[script]}), {steps} steps. Run directory: {escape(str(root))}")
    with tempfile.TemporaryDirectory(prefix="unbroken-demo-pool-") as pool_dir, \
            pool.running(Path(pool_dir) / pool.SOCKET_NAME) as pool_socket:
        # Both runs fork their ranks from one pool: torch is imported once, before the first launch.
        common["pool_socket"] = str(pool_socket or "")
        return _demo(console, root, common, args, steps, nproc, script, live)


def _demo(console: Console, root: Path, common: dict[str, Any], args: tuple[str, ...], steps: int, nproc: int,
          script: str, live: bool) -> int:
    ref = resolve(LaunchConfig(**common, script_args=args + ("--out", str(root / "reference.safetensors")),
                               run_dir=root / "reference"))
    ref_result, _ = _run(console, "reference run (no faults)", ref, live)
    if ref_result.exit_code != 0:
        console.print(f"[red]the reference run failed: {escape(ref_result.reason)}")
        return 1
    plan = fault_plan(script, steps, nproc)
    console.print(f"faulty run: injecting [bold]{plan}[/bold]")
    faulty = resolve(LaunchConfig(**common, script_args=args + ("--out", str(root / "faulty.safetensors")),
                                  run_dir=root / "faulty", inject=plan,
                                  checkpoint=CheckpointConfig(save_dir=str(root / "ckpt"), every_steps=5)))
    result, snapshot = _run(console, "faulty run", faulty, live)
    rows = summarize(faulty.run_dir)
    console.print(_recovery_table(rows))
    recovered = [r for r in rows if r["recovered"] is not None]
    equal = result.exit_code == 0 and _weights_equal(root / "reference.safetensors", root / "faulty.safetensors")
    losses = [w["metrics"].get("loss") for w in snapshot["workers"]]
    console.print(f"faults injected: {len(rows)}, recovered: {len(recovered)}"
                  + (f", final loss (rank 0): {losses[0]:.4f}" if losses and losses[0] is not None else ""))
    console.print(f"final weights equal to the fault-free run, bit for bit: "
                  f"{'[green]yes' if equal else '[red]NO'}")
    _timeline(console, faulty.run_dir, plan)
    ok = result.exit_code == 0 and equal and len(recovered) == len(rows) == len(plan.split(","))
    console.print("[bold green]demo passed" if ok else "[bold red]demo FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(run_demo())
