"""Goodput soak: the example on 4 ranks for --duration-s under an outside fault every --fault-every-s.

    python benchmarks/goodput.py --json goodput.json                  # 10 minutes, a fault every 30 s
    python benchmarks/goodput.py --duration-s 120 --seed 7 --json g.json

Three launches of `unbroken run --nproc-per-node 4 examples/train_gpt.py` (default recovery
strategies, --step-sleep-s as given):

  calibration  a short fault-free run: its median time per step sets the step count N of the
               soak, --steps-margin x what --duration-s takes at that pace, so that the faulty
               run trains for at least --duration-s even if the machine gets quieter (a shared
               machine's step time moves by tens of per cent)
  soak         N steps; once its first step completed, every --fault-every-s the benchmark itself
               (from outside, like an operator or the kernel) sends SIGKILL or SIGSTOP (drawn at
               random, --seed) to the process of a random rank (its newest `rank_started` pid).
               No fault in the last --fault-every-s / 2 of the run (at the pace seen so far), so
               every fault has time to be recovered
  reference    the same N steps with no fault: the comparison for goodput and the final weights

Row ``soak``:
  goodput    productive time over wall time after start-up, precisely:
               (reference's t(step N) - t(step 1)) / (soak's t(step N) - t(step 1)),
             t(step k) being the controller's `step` event of the k-th completed step
             (events.jsonl). The numerator is what the N - 1 steps after the first cost without
             faults; the denominator is what they cost with them (detection, recovery, redone
             steps, the work a replacement process does on a shared machine). 1.0 = no loss.
  faults     faults sent; ``sigkill``, ``sigstop`` of them
  recovered  faults followed by a recovery (`recovered_in_flight` or `recovered` event) before the
             next fault or the job's end, the job having ended with exit 0
  bit_equal  the soak's final weights equal the reference's bit for bit
  plus ``wall_s`` and ``steps_per_s`` of both runs, ``per_fault_cost_s`` ((soak span - reference
  span) / faults), and unbroken's own breakdown of the soak's wall from its event log
  (ops/goodput.py, the `unbroken report` figures): ``unbroken_goodput`` (start-up counted as
  badput), ``unbroken_goodput_after_startup`` (productive / (wall - start-up)),
  ``unbroken_recovery_s_per_fault`` (detect + replace + regroup + restore + redo, per fault) and
  ``unbroken_seconds``. On a shared machine the two runs see different loads: goodput moves with
  that; the breakdown, from one run, does not.
A timeline picture (steps of every rank over time, faults and recovery phases marked:
unbroken/ops/plot.py, the `unbroken report --plot` picture) is written next to --json as
``<json stem>.png`` (or --png) when matplotlib imports.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from recovery_run import load_weights, same_weights
from runlib import REPO, clean_shm, launch, median, read_events, unbroken_cmd, worker_pid

NPROC = 4
STEP_LINE = re.compile(r"^\[rank 0\] step (\d+): ")  # the example's line after each step (--log-every 1)
TARGET_GOODPUT = 0.95
EXAMPLE = REPO / "examples" / "train_gpt.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=600.0, help="how long the faulty run trains (about)")
    p.add_argument("--fault-every-s", type=float, default=30.0, help="one outside fault this often")
    p.add_argument("--faults", default="sigkill,sigstop", help="kinds drawn from: sigkill, sigstop (comma list)")
    p.add_argument("--seed", type=int, default=0, help="seed of the rank and kind drawn for each fault")
    p.add_argument("--step-sleep-s", type=float, default=0.05, help="the example's sleep per step")
    p.add_argument("--calibration-steps", type=int, default=60)
    p.add_argument("--steps-margin", type=float, default=1.25,
                   help="the soak's steps: this x --duration-s / the calibration's median step")
    p.add_argument("--steps", type=int, default=0, help="the soak's steps (0: from the calibration run)")
    p.add_argument("--run-timeout-s", type=float, default=0.0, help="a launch still going after this is killed "
                   "(0: 3 x --duration-s + 300)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the figures here (BENCHMARKS.md layout)")
    p.add_argument("--png", default=None, metavar="PATH", help="the timeline picture (default: next to --json)")
    p.add_argument("--keep", default=None, metavar="DIR", help="keep the run directories here")
    p.add_argument("--verbose", action="store_true", help="echo every launcher's output")
    args = p.parse_args(argv)
    kinds = [k.strip() for k in args.faults.split(",") if k.strip()]
    if not kinds or any(k not in ("sigkill", "sigstop") for k in kinds):
        p.error(f"--faults: {args.faults!r}: give a comma list of sigkill, sigstop")
    args.kinds = kinds
    if args.run_timeout_s <= 0:
        args.run_timeout_s = 3 * args.duration_s + 300
    return args


class Faulter:
    """Sends the soak's outside faults from a thread: the first --fault-every-s after the first
    completed step, then every --fault-every-s while more than half of that is left of the run's
    ``steps`` at the pace seen so far (rank 0's step lines)."""

    def __init__(self, run_dir: Path, every_s: float, kinds: list[str], seed: int, steps: int) -> None:
        self.run_dir, self.every_s, self.kinds, self.steps = run_dir, every_s, kinds, steps
        self.rng = random.Random(seed)
        self.sent: list[dict] = []
        self.first_step_t: float | None = None
        self.last_step = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="faulter", daemon=True)

    def on_line(self, t: float, line: str) -> None:
        m = STEP_LINE.match(line)
        if m is None:
            return
        self.last_step = max(self.last_step, int(m[1]) + 1)  # completed steps (the line counts from 0)
        if self.first_step_t is None:
            self.first_step_t = t
            self._thread.start()

    def _left_s(self) -> float:
        """The run's time left at the pace seen so far."""
        assert self.first_step_t is not None
        done = max(1, self.last_step - 1)
        return (self.steps - self.last_step) * (time.time() - self.first_step_t) / done

    def stop(self) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        assert self.first_step_t is not None
        next_t = self.first_step_t + self.every_s
        while not self._done.wait(max(0.0, next_t - time.time())):
            if self._left_s() < self.every_s / 2:
                return
            rank, kind = self.rng.randrange(NPROC), self.rng.choice(self.kinds)
            pid = worker_pid(self.run_dir, rank)
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL if kind == "sigkill" else signal.SIGSTOP)
                    self.sent.append({"t": time.time(), "rank": rank, "kind": kind, "pid": pid})
                except ProcessLookupError:
                    pass  # it was just replaced: the next fault comes on time anyway
            next_t += self.every_s


def run_example(name: str, workdir: Path, args: argparse.Namespace, steps: int, env: dict[str, str],
                faulter_for: type | None = None) -> dict:
    """One launch; returns its figures (events, step times, weights, the faults it got)."""
    d = workdir / name
    d.mkdir()
    out = d / "weights.safetensors"
    cmd = [*unbroken_cmd(), "run", "--nproc-per-node", str(NPROC), "--run-dir", str(d / "run"),
           "--first-step-timeout-s", "300", str(EXAMPLE), "--steps", str(steps), "--optimizer", "plain",
           "--step-sleep-s", str(args.step_sleep_s), "--log-every", "1", "--out", str(out)]
    faulter = None
    if faulter_for is not None:
        faulter = faulter_for(d / "run", args.fault_every_s, args.kinds, args.seed, steps)
    print(f"{name}: {steps} steps ...", flush=True)
    res = launch(cmd, env, args.run_timeout_s, args.verbose, on_line=faulter.on_line if faulter else None)
    if faulter is not None:
        faulter.stop()
    events = read_events(d / "run")
    clean_shm(d / "run")
    step_t = {}
    for ev in events:
        if ev.get("event") == "step":
            step_t.setdefault(int(ev["step"]), float(ev["t"]))
    result = {"name": name, "rc": res.rc, "timed_out": res.timed_out, "wall_s": res.job_s, "events": events,
              "step_t": step_t, "weights": load_weights(out, "gpt") if res.rc == 0 else None,
              "faults": faulter.sent if faulter else [], "tail": [line for _, line in res.lines[-15:]]}
    print(f"  exit {res.rc}, {res.job_s:.1f} s, {len(step_t)} steps recorded"
          + (f", {len(result['faults'])} faults sent" if faulter else ""), flush=True)
    return result


def span_s(run: dict, steps: int) -> float | None:
    """t(step N) - t(step 1) of a run (see the module docstring)."""
    t = run["step_t"]
    return t[steps] - t[1] if 1 in t and steps in t else None


def recovered_faults(run: dict) -> int:
    """Faults followed by a recovery event before the next fault (or the end), in a run that ended 0."""
    if run["rc"] != 0:
        return 0
    done = sorted(float(ev["t"]) for ev in run["events"] if ev.get("event") in ("recovered_in_flight", "recovered"))
    faults = [f["t"] for f in run["faults"]]
    n = 0
    for i, t in enumerate(faults):
        until = faults[i + 1] if i + 1 < len(faults) else math.inf
        n += any(t <= r < until for r in done)
    return n


def soak_row(soak: dict, ref: dict, steps: int) -> dict:
    from unbroken.ops import goodput as gp

    faulty, clean = span_s(soak, steps), span_s(ref, steps)
    faults = soak["faults"]
    row = {"name": "soak", "steps": steps,
           "goodput": None if not faulty or clean is None else round(clean / faulty, 4),
           "faults": len(faults), "sigkill": sum(f["kind"] == "sigkill" for f in faults),
           "sigstop": sum(f["kind"] == "sigstop" for f in faults), "recovered": recovered_faults(soak),
           "bit_equal": (soak["weights"] is not None and ref["weights"] is not None
                         and same_weights(soak["weights"], ref["weights"])),
           "soak_span_s": None if faulty is None else round(faulty, 3),
           "reference_span_s": None if clean is None else round(clean, 3),
           "soak_wall_s": round(soak["wall_s"], 3), "reference_wall_s": round(ref["wall_s"], 3),
           "soak_exit": soak["rc"], "reference_exit": ref["rc"]}
    if faulty and clean is not None and faults:
        row["per_fault_cost_s"] = round((faulty - clean) / len(faults), 3)
    if faulty:
        row["steps_per_s"] = round((steps - 1) / faulty, 3)
    if clean:
        row["reference_steps_per_s"] = round((steps - 1) / clean, 3)
    if soak["events"]:
        bd = gp.breakdown(soak["events"])
        row["unbroken_goodput"] = round(bd.goodput, 4)
        row["unbroken_seconds"] = {k: round(v, 3) for k, v in bd.seconds.items()}
        after_startup_s = bd.wall_s - bd.seconds.get("startup", 0.0)
        if after_startup_s > 0:
            row["unbroken_goodput_after_startup"] = round(bd.seconds.get("productive", 0.0) / after_startup_s, 4)
        badput = sum(bd.seconds.get(k, 0.0) for k in gp.PHASES)
        if faults:
            row["unbroken_recovery_s_per_fault"] = round(badput / len(faults), 3)
    detected = [float(ev["t"]) for ev in soak["events"] if ev.get("event") == "hang_detected"]
    stops = [f["t"] for f in faults if f["kind"] == "sigstop"]
    waits = [min((t for t in detected if t >= s), default=math.nan) - s for s in stops]
    if waits and not any(math.isnan(w) for w in waits):
        row["hang_detect_s"] = round(median(waits), 3)
    return row


def write_picture(soak: dict, path: Path, args: argparse.Namespace, row: dict) -> str:
    try:
        from unbroken.errors import ConfigError
        from unbroken.ops.plot import write_png
    except ImportError as exc:
        return f"no picture: {exc}"
    title = (f"goodput soak: {row['faults']} outside faults (SIGKILL/SIGSTOP of a random rank every "
             f"{args.fault_every_s:.0f} s, seed {args.seed}), goodput {row['goodput']}")
    try:
        return f"timeline picture: {write_png(soak['events'], path, title=title)}"
    except (ConfigError, ImportError) as exc:
        return f"no picture: {exc}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load0 = os.getloadavg()[0]
    workdir = Path(tempfile.mkdtemp(prefix="unbroken-goodput-"))
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", TMPDIR=str(workdir), PYTHONUNBUFFERED="1")
    for key in [k for k in env if k.startswith("UNBROKEN_")]:
        del env[key]
    try:
        steps = args.steps
        if not steps:
            cal = run_example("calibration", workdir, args, args.calibration_steps, env)
            per = [float(ev["step_s"]) for ev in cal["events"] if ev.get("event") == "step" and "step_s" in ev][1:]
            if cal["rc"] != 0 or not per:
                print(f"the calibration run failed (exit {cal['rc']}):\n  " + "\n  ".join(cal["tail"]))
                return 1
            args.per_step_s = median(per)
            steps = max(10, math.ceil(args.steps_margin * args.duration_s / args.per_step_s))
            print(f"calibration: median step {args.per_step_s * 1000:.1f} ms -> {steps} steps for "
                  f"{args.duration_s:.0f} s (x {args.steps_margin} margin)", flush=True)
        else:
            args.per_step_s = args.duration_s / steps
        soak = run_example("soak", workdir, args, steps, env, faulter_for=Faulter)
        ref = run_example("reference", workdir, args, steps, env)
        row = soak_row(soak, ref, steps)
        load1 = os.getloadavg()[0]
        png = Path(args.png) if args.png else (Path(args.json).with_suffix(".png") if args.json else None)
        picture = write_picture(soak, png, args, row) if png else "no picture (give --json or --png)"
        print_table(row, args, load0, load1, picture)
        for run in (soak, ref):
            if run["rc"] != 0:
                print(f"{run['name']} exited {run['rc']} (timed out: {run['timed_out']}); its last lines:\n  "
                      + "\n  ".join(run["tail"]))
        if args.json:
            report = {"benchmark": "goodput",
                      "params": {"nproc": NPROC, "duration_s": args.duration_s, "fault_every_s": args.fault_every_s,
                                 "faults": args.kinds, "seed": args.seed, "step_sleep_s": args.step_sleep_s,
                                 "steps": steps, "calibrated_step_s": round(args.per_step_s, 5),
                                 "load_before": round(load0, 2), "load_after": round(load1, 2)},
                      "machine": machine(), "rows": [row],
                      "fault_log": [{**f, "t": round(f["t"] - soak["step_t"].get(1, 0.0), 3)} for f in soak["faults"]]}
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
            print(f"wrote {args.json}")
        if args.keep:
            shutil.copytree(workdir, Path(args.keep) / workdir.name, dirs_exist_ok=True)
        return 0
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def machine() -> dict:
    import torch

    return {"cpus": os.cpu_count(), "torch": torch.__version__, "python": sys.version.split()[0]}


def print_table(row: dict, args: argparse.Namespace, load0: float, load1: float, picture: str) -> None:
    print(f"\ngoodput soak: examples/train_gpt.py on {NPROC} ranks, {row['steps']} steps "
          f"(--step-sleep-s {args.step_sleep_s}), an outside fault every {args.fault_every_s:.0f} s "
          f"(seed {args.seed}, {', '.join(args.kinds)})")
    fmt = lambda v, f="{:.3f}": "-" if v is None else f.format(v)  # noqa: E731
    lines = [("", "soak", "reference"),
             ("exit", str(row["soak_exit"]), str(row["reference_exit"])),
             ("wall_s", fmt(row["soak_wall_s"], "{:.1f}"), fmt(row["reference_wall_s"], "{:.1f}")),
             ("step 1 -> step N, s", fmt(row["soak_span_s"], "{:.1f}"), fmt(row["reference_span_s"], "{:.1f}")),
             ("steps/s", fmt(row.get("steps_per_s"), "{:.2f}"), fmt(row.get("reference_steps_per_s"), "{:.2f}"))]
    for a, b, c in lines:
        print(f"  {a:<22}{b:>12}{c:>12}")
    print(f"  goodput {fmt(row['goodput'], '{:.4f}')} (target >= {TARGET_GOODPUT}: "
          f"{'met' if row['goodput'] is not None and row['goodput'] >= TARGET_GOODPUT else 'NOT met'}), "
          f"faults {row['faults']} (SIGKILL {row['sigkill']}, SIGSTOP {row['sigstop']}), recovered {row['recovered']}, "
          f"bit-equal {row['bit_equal']}, per fault {fmt(row.get('per_fault_cost_s'))} s, "
          f"SIGSTOP -> hang detected {fmt(row.get('hang_detect_s'))} s")
    print(f"  from the soak's event log (ops/goodput.py): goodput {fmt(row.get('unbroken_goodput'), '{:.4f}')} "
          f"(start-up counted), {fmt(row.get('unbroken_goodput_after_startup'), '{:.4f}')} after start-up; "
          f"recovery {fmt(row.get('unbroken_recovery_s_per_fault'))} s per fault")
    print(f"  goodput = reference (t(step N) - t(step 1)) / soak's; load average (1 min) before / after "
          f"{load0:.1f} / {load1:.1f} on {os.cpu_count()} cpus")
    print(f"  {picture}")


if __name__ == "__main__":
    sys.exit(main())
