"""Recovery benchmark: what one lost rank costs, unbroken vs a job-level restart.

    python benchmarks/recovery.py                          # 4 ranks, kill rank 2 at step 25 of 40
    python benchmarks/recovery.py --repeats 1 --json recovery.json
    python benchmarks/recovery.py --script ddp --rows unbroken_recover_in_place,torchrun_restart   # stock DDP
    python benchmarks/recovery.py --script fsdp --rows unbroken_recover_in_place,torchrun_restart  # FSDP2 HSDP 2x2
    python benchmarks/recovery.py --script pp --rows unbroken_recover_in_place,torchrun_restart    # PP2 x DP2

Every run trains the example GPT on 4 ranks (--script: examples/train_gpt.py, train_ddp.py with
stock DDP, train_fsdp.py with FSDP2 HSDP on a 2x2 mesh, or train_3d.py as PP2 x DP2: rank 2 is
stage 1 of replica 0, its stage comes from rank 3; the weights compared are every rank's stage
file) and SIGKILLs rank 2 when
it enters step --kill-step (the hang row SIGSTOPs it instead). Rows (BENCHMARKS.md names), interleaved A B C D A B C D:

  unbroken_recover_in_place  `unbroken run --inject kill:...` (default strategy
                             recover-in-place,exit): the lost rank is replaced in flight
  unbroken_recover_in_place_prerun  the same with --prerun-spares: the replacement is a spare that
                             ran the script up to its first rank-dependent read (note: used, or
                             not ready at the fault: a cold start)
  unbroken_hang_in_place     the same, but no --inject: the benchmark SIGSTOPs rank 2's worker once
                             rank 0 completed step --kill-step - 1; the controller's hang detector
                             finds it (timeout printed: calibrated, or --hang-timeout-s), the agent
                             kills it, and it is replaced in flight. Its recover_s counts from the
                             SIGSTOP; hang_detect_s is SIGSTOP -> the `hang_detected` event
  unbroken_restart_memory    `--recover-strategy exit --save DIR --ckpt-every-steps 1
                             --persist-every-steps C`: job restart from the shared-memory tier
                             (only when `unbroken run` has --persist-every-steps)
  unbroken_restart_storage   `--recover-strategy exit --save DIR --ckpt-every-steps C`; where the
                             memory tier exists, `--ckpt-every-steps 0 --persist-every-steps C`
                             instead (no shared-memory snapshots: each worker writes storage every
                             C steps and the restart restores from storage, as the row says)
  torchrun_restart           `python -m torch.distributed.run --max-restarts 1 --rdzv-backend c10d`
                             with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (see FACTS.md). The example
                             checkpoints every C steps through UNBROKEN_SAVE_DIR /
                             UNBROKEN_CKPT_EVERY_STEPS: unbroken's storage tier, written
                             synchronously by each worker -- what a user of the example gets
                             under plain torchrun. The fault comes from UNBROKEN_INJECT with a
                             marker file in UNBROKEN_RUN_DIR, so it fires once per job.
  torchft                    not implemented; reported as skipped (and whether torchft imports)

Figures, measured the same way for every row from the launcher's merged output, each line
stamped with time.time() when it arrives (rank 0 prints every step: --log-every 1):
  recover_s    arrival of the "injecting fault" line (the worker logs it just before its
               SIGKILL) -> arrival of the first line of a completed step >= --kill-step
  lost_steps   completed steps that were completed again (a step index printed twice)
  job_s        the launcher's whole wall time, start to exit
A step that unbroken aborts in flight still runs the example's print after `with job.step():`;
that line follows rank 0's "step N aborted" warning and is not counted as a completion.
For unbroken rows the run directory's events.jsonl adds the controller's own figures
(controller_recover_s counts from fault *detection*; in-flight: detect/replace/regroup/restore).
Every run's final weights are compared bit for bit with a fault-free `unbroken run`.
A benchmark never asserts a time: the target is printed, met or not.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from recovery_run import (KILL_RANK, NPROC, STEP_RE, STEP_RES, Run, add_event_figures, analyze, load_weights,
                          prerun_note, same_weights)
from runlib import (REPO, clean_shm, free_port, in_flight, kill_tree, launch, median, read_events,
                    unbroken_cmd, worker_pid)

EXAMPLES = {"gpt": REPO / "examples" / "train_gpt.py", "ddp": REPO / "examples" / "train_ddp.py",
            "fsdp": REPO / "examples" / "train_fsdp.py", "pp": REPO / "examples" / "train_3d.py"}
LAYOUT_ARGS = {"pp": ["--pp", "2", "--dp", "2"]}  # train_3d.py: PP2 x DP2 on the 4 ranks
IN_PLACE = "unbroken_recover_in_place"
HANG = "unbroken_hang_in_place"
PRERUN = "unbroken_recover_in_place_prerun"  # the same with --prerun-spares (agent/prerun.py)
ROWS = ("unbroken_recover_in_place", PRERUN, HANG, "unbroken_restart_memory", "unbroken_restart_storage",
        "torchrun_restart", "torchft")
TARGET_RATIOS = {"gpt": 15.0, "ddp": 4.0, "fsdp": 4.0, "pp": 4.0}  # recover-in-place vs torchrun_restart, 0 lost
# (issue 17 for the example's own loop; issue 13 for the stock DDP / FSDP2 wrappers; issue 14 for PP2 x DP2)
TARGET_RESTORE_S = 0.15  # recover-in-place restore_s at most this (issue 17)

def has_memory_tier() -> bool:
    """Whether this unbroken's `run` has the shared-memory tier's --persist-every-steps."""
    out = subprocess.run([*unbroken_cmd(), "run", "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    return "--persist-every-steps" in out.stdout


# -----------------------------------------------------------------------------------------
# The rows.

class Stopper:
    """The hang row's fault: SIGSTOP rank KILL_RANK's worker once rank 0 has completed step
    ``kill_step - 1`` (so the rank freezes in step kill_step or just before it). Runs in the
    launcher's reader thread; the worker's pid comes from the run's events.jsonl."""

    def __init__(self, run_dir: Path, kill_step: int, step_re: re.Pattern = STEP_RE) -> None:
        self.run_dir, self.kill_step, self.step_re = run_dir, kill_step, step_re
        self.stop_t: float | None = None
        self.error = ""

    def on_line(self, t: float, line: str) -> None:
        m = self.step_re.match(line)
        if self.stop_t is not None or self.error or not m or m[1] not in (None, "0") \
                or int(m[2]) != self.kill_step - 1:
            return
        pid = worker_pid(self.run_dir, KILL_RANK)
        if pid is None:
            self.error = f"no rank_started event for rank {KILL_RANK}: nothing to SIGSTOP"
            return
        os.kill(pid, signal.SIGSTOP)
        self.stop_t = time.time()


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path, memory_tier: bool) -> None:
        self.args = args
        self.memory_tier = memory_tier
        self.workdir = workdir
        self.counter = 0
        self.reference: dict | None = None
        env = dict(os.environ)
        env.update(OMP_NUM_THREADS="1", TMPDIR=str(workdir / "tmp"), PYTHONUNBUFFERED="1")
        for key in [k for k in env if k.startswith("UNBROKEN_")]:
            del env[key]  # nothing from the caller's environment steers these runs
        self.env = env
        (workdir / "tmp").mkdir()

    def script_args(self, out: Path) -> list[str]:
        a = self.args
        return [str(EXAMPLES[a.script]), *LAYOUT_ARGS.get(a.script, []), "--steps", str(a.steps),
                "--optimizer", a.optimizer,
                "--step-sleep-s", str(a.step_sleep_s), "--log-every", "1", "--out", str(out)]

    def fresh_dir(self, name: str) -> Path:
        self.counter += 1
        d = self.workdir / f"{self.counter:03d}-{name}"
        d.mkdir()
        return d

    @property
    def inject(self) -> str:
        return f"kill:rank={KILL_RANK}:step={self.args.kill_step}"

    def reference_run(self) -> Run:
        d = self.fresh_dir("reference")
        out = d / "weights.safetensors"
        cmd = [*unbroken_cmd(), "run", "--nproc-per-node", str(NPROC), "--run-dir", str(d / "run"),
               *self.script_args(out)]
        res = launch(cmd, self.env, self.args.run_timeout_s, self.args.verbose)
        run = Run("reference", job_s=res.job_s)
        clean_shm(d / "run")
        self.reference = load_weights(out, self.args.script) if res.rc == 0 else None
        if self.reference is None:
            run.problems.append(f"fault-free reference run failed (exit {res.rc}, timed out {res.timed_out})")
            run.tail = [line for _, line in res.lines[-15:]]
        return run

    def command(self, name: str, d: Path, out: Path) -> tuple[list[str], dict[str, str]]:
        a, env = self.args, dict(self.env)
        base = [*unbroken_cmd(), "run", "--nproc-per-node", str(NPROC), "--run-dir", str(d / "run"),
                "--inject", self.inject]
        if name in (IN_PLACE, PRERUN):
            return [*base, *(["--prerun-spares"] if name == PRERUN else []), *self.script_args(out)], env
        if name == HANG:  # no --inject: the benchmark SIGSTOPs the rank itself (Stopper)
            hang = [] if a.hang_timeout_s is None else ["--hang-timeout-s", str(a.hang_timeout_s)]
            return [*base[:-2], *hang, *self.script_args(out)], env
        if name == "unbroken_restart_memory":
            return [*base, "--recover-strategy", "exit", "--save", str(d / "ckpt"), "--ckpt-every-steps", "1",
                    "--persist-every-steps", str(a.ckpt_every), *self.script_args(out)], env
        if name == "unbroken_restart_storage":
            every = (["--ckpt-every-steps", "0", "--persist-every-steps", str(a.ckpt_every)] if self.memory_tier
                     else ["--ckpt-every-steps", str(a.ckpt_every)])
            return [*base, "--recover-strategy", "exit", "--save", str(d / "ckpt"), *every,
                    *self.script_args(out)], env
        if name == "torchrun_restart":
            env.update(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", UNBROKEN_SAVE_DIR=str(d / "ckpt"),
                       UNBROKEN_CKPT_EVERY_STEPS=str(a.ckpt_every), UNBROKEN_INJECT=self.inject,
                       UNBROKEN_RUN_DIR=str(d / "run"))
            (d / "run").mkdir()
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(NPROC),
                   "--max-restarts", "1", "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"127.0.0.1:{free_port()}", *self.script_args(out)]
            return cmd, env
        raise ValueError(name)

    def run_row(self, name: str) -> Run:
        d = self.fresh_dir(name)
        out = d / "weights.safetensors"
        cmd, env = self.command(name, d, out)
        step_re = STEP_RES.get(self.args.script, STEP_RE)
        stopper = Stopper(d / "run", self.args.kill_step, step_re) if name == HANG else None
        res = launch(cmd, env, self.args.run_timeout_s, self.args.verbose,
                     on_line=stopper.on_line if stopper else None)
        if self.args.keep_logs:
            log_dir = Path(self.args.keep_logs)
            log_dir.mkdir(parents=True, exist_ok=True)
            (log_dir / f"{d.name}.log").write_text("".join(f"{t:.6f} {line}\n" for t, line in res.lines))
        run = Run(name, job_s=res.job_s)
        stop_t = stopper.stop_t if stopper else None
        if stopper and stopper.error:
            run.problems.append(stopper.error)
        analyze(run, res.lines, self.args.kill_step, self.args.steps, fault_t=stop_t, step_re=step_re)
        if name.startswith("unbroken_"):
            add_event_figures(run, read_events(d / "run"), stop_t)
            if name == PRERUN:
                run.notes.append(prerun_note(read_events(d / "run")))
            leftover = clean_shm(d / "run")
            if leftover:
                run.notes.append(f"removed {len(leftover)} leftover /dev/shm file(s)")
        if res.timed_out:
            run.timed_out, run.job_s = True, None  # the job never finished: no job_s
            run.problems.append(f"timed out after {self.args.run_timeout_s:.0f} s")
        elif res.rc != 0:
            run.problems.append(f"exit code {res.rc}")
        got = load_weights(out, self.args.script)
        if got is not None and self.reference is not None:
            run.weights_equal = same_weights(got, self.reference)
        else:
            run.problems.append("no final weights written")
        if not run.ok:
            notable = [line for _, line in res.lines
                       if re.search(r"terminate called|abort|core dumped|fatal", line, re.I)]
            run.tail = notable[:10] + ["..."] + [line for _, line in res.lines[-15:]]
        shutil.rmtree(d, ignore_errors=True)  # checkpoints of a run are not needed afterwards
        return run


# -----------------------------------------------------------------------------------------
# Summaries, the table, the JSON.

def summarize(runs: list[Run]) -> dict:
    good = [r for r in runs if r.recover_s is not None]
    row: dict = {}
    if good:
        row["recover_s"] = round(median([r.recover_s for r in good]), 4)
        row["lost_steps"] = median([r.lost_steps for r in good])
        if float(row["lost_steps"]).is_integer():
            row["lost_steps"] = int(row["lost_steps"])
    jobs = [r.job_s for r in runs if r.job_s is not None]
    if jobs:
        row["job_s"] = round(median(jobs), 4)
    extra_keys = sorted({k for r in good for k in r.extra})
    for key in extra_keys:
        vals = [r.extra[key] for r in good if key in r.extra]
        row[key] = round(median(vals), 4)
    checked = [r.weights_equal for r in runs if r.weights_equal is not None]
    row["weights_equal"] = bool(checked) and all(checked)
    row["failed_runs"] = sum(not r.ok for r in runs)
    row["runs"] = [{"recover_s": None if r.recover_s is None else round(r.recover_s, 4),
                    "lost_steps": r.lost_steps, "job_s": None if r.job_s is None else round(r.job_s, 4),
                    "weights_equal": r.weights_equal,
                    **{k: round(r.extra[k], 4) for k in ("hang_detect_s", "detect_s") if k in r.extra},
                    **({"problems": r.problems} if r.problems else {})}
                   for r in runs]
    return row


def spread(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    med = fmt.format(median(values))
    if len(values) == 1:
        return med
    return f"{med} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def print_table(args: argparse.Namespace, results: dict[str, list[Run]], skipped: dict[str, str],
                reference: Run) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 140)
    base = results.get(IN_PLACE, [])
    base_rec = [r.recover_s for r in base if r.recover_s is not None]
    base_med = median(base_rec) if base_rec else None
    table = Table(title=f"recovery of examples/{EXAMPLES[args.script].name}: {NPROC} ranks, kill rank {KILL_RANK} at step {args.kill_step} of "
                        f"{args.steps}, checkpoints every {args.ckpt_every} steps, optimizer {args.optimizer}, "
                        f"{args.step_sleep_s} s sleep/step, {args.repeats} repeat(s); median (min-max)")
    for col, just in (("row", "left"), ("recover_s", "right"), ("x in-place", "right"),
                      ("lost_steps", "right"), ("job_s", "right"), ("weights", "left"), ("restored from / note", "left")):
        table.add_column(col, justify=just, no_wrap=col == "row")
    footnotes: list[str] = []
    for name in ROWS:
        if name in skipped:
            table.add_row(name, "n/a", "", "", "", "", skipped[name].removeprefix("n/a ").strip("()"))
            continue
        if name not in results:
            continue  # not chosen (--rows)
        runs = results[name]
        rec = [r.recover_s for r in runs if r.recover_s is not None]
        lost = [float(r.lost_steps) for r in runs if r.recover_s is not None and r.lost_steps is not None]
        jobs = [r.job_s for r in runs if r.job_s is not None]
        ratio = f"{median(rec) / base_med:.1f}x" if rec and base_med else "-"
        checked = [r.weights_equal for r in runs if r.weights_equal is not None]
        if not checked:
            weights = "[red]not checked[/red]"
        elif all(checked):
            weights = "equal"
        else:
            weights = f"[red]DIFFER ({checked.count(False)}/{len(checked)})[/red]"
        source = sorted({n for r in runs for n in r.notes})
        if name == "torchrun_restart":
            resumes = sorted({int(r.extra["resume_step"]) for r in runs if "resume_step" in r.extra})
            source = [f"storage (sync, in the worker), step {', '.join(map(str, resumes)) or '?'}"]
        failed = sum(not r.ok for r in runs)
        if failed:
            source.append(f"[red]{failed} run(s) failed[/red]")
        table.add_row(name, spread(rec, "{:.2f}"), ratio, spread(lost, "{:.0f}"), spread(jobs, "{:.1f}"),
                      weights, "; ".join(source))
        keys = [k for k in ("controller_recover_s", "hang_timeout_s", "hang_detect_s", "detect_s", "replace_s",
                            "regroup_s", "restore_s", "total_s", "rp_script_s", "rp_receive_s", "rp_load_s",
                            "rp_replacement_s", "rp_survivor_max_s")
                if any(k in r.extra for r in runs)]
        if keys:
            footnotes.append(f"{name}, from events.jsonl: " + ", ".join(
                f"{k} {median([r.extra[k] for r in runs if k in r.extra]):.3f}" for k in keys))
    console.print(table)
    for line in footnotes:
        console.print(line, highlight=False)
    console.print("torchrun_restart: the example's checkpoints under plain torchrun (UNBROKEN_SAVE_DIR, "
                  "UNBROKEN_CKPT_EVERY_STEPS): unbroken's storage tier, written synchronously by each worker")
    console.print("rp_*: restore_s taken apart (restore_phases events): the replacement's script between "
                  "unbroken.init() and job.steps(), its receive rounds, its loads, its own restore; the survivors' "
                  "longest restore (they wait for the replacement's script)")
    console.print(f"fault-free reference (unbroken run, no fault): job_s {reference.job_s:.1f}")
    console.print("recover_s: 'injecting fault' line -> first completed step >= the fault step (rank 0's "
                  "output, stamped on arrival); lost_steps: completed steps computed again; "
                  "x in-place: recover_s / unbroken_recover_in_place's")
    target_ratio = TARGET_RATIOS[args.script]
    tr = [r.recover_s for r in results.get("torchrun_restart", []) if r.recover_s is not None]
    base_lost = [r.lost_steps for r in base if r.recover_s is not None]
    if base_med and tr:
        ratio = median(tr) / base_med
        met = ratio >= target_ratio and base_lost and all(x == 0 for x in base_lost) and len(base_lost) == len(base)
        console.print(f"target: recover-in-place at least {target_ratio:.0f}x faster than torchrun_restart with 0 "
                      f"steps lost -> measured {ratio:.1f}x, lost steps {base_lost}: "
                      + ("[green]met[/green]" if met else "[red]NOT met[/red]"))
    else:
        console.print(f"target: recover-in-place at least {target_ratio:.0f}x faster than torchrun_restart with 0 "
                      "steps lost -> [red]could not be evaluated (missing measurements)[/red]")
    restore = [r.extra["restore_s"] for r in base if "restore_s" in r.extra]
    if restore:
        console.print(f"target: recover-in-place restore_s <= {TARGET_RESTORE_S} s -> measured {median(restore):.3f} s: "
                      + ("[green]met[/green]" if median(restore) <= TARGET_RESTORE_S else "[red]NOT met[/red]"))
    hang = [r for r in results.get(HANG, []) if "hang_timeout_s" in r.extra]
    if hang:
        console.print(f"{HANG}: rank {KILL_RANK} SIGSTOPped after rank 0 completed step {args.kill_step - 1}; "
                      f"hang timeout used {median([r.extra['hang_timeout_s'] for r in hang]):.2f} s "
                      f"({'--hang-timeout-s' if args.hang_timeout_s else '0.25 s for a process seen stopped with no rank behind it, else calibrated: max(1 s, 3 x p99 step) with other evidence against the rank, else max(5 s, ...)'}), "
                      f"SIGSTOP -> hang detected {spread([r.extra['hang_detect_s'] for r in hang], '{:.2f}')} s "
                      f"(target <= 1.5 s), "
                      f"-> back at the step {median([r.recover_s for r in hang if r.recover_s is not None] or [0]):.2f} s")
    for name, runs in results.items():
        for i, r in enumerate(runs):
            if r.problems:
                console.print(f"[red]{name} run {i + 1}: {'; '.join(r.problems)}[/red]")
                for line in r.tail:
                    console.print(f"    {line}", markup=False, highlight=False)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="training steps per run")
    p.add_argument("--kill-step", type=int, default=25, help=f"rank {KILL_RANK} is SIGKILLed entering this step")
    p.add_argument("--ckpt-every", type=int, default=10, help="checkpoint interval of the restart rows (steps)")
    p.add_argument("--repeats", type=int, default=3, help="runs per row, interleaved")
    p.add_argument("--step-sleep-s", type=float, default=0.05, help="sleep per step (--step-sleep-s of the example)")
    p.add_argument("--script", choices=sorted(EXAMPLES), default="gpt",
                   help="gpt: train_gpt.py (its own loop); ddp: train_ddp.py (stock DDP); "
                        "fsdp: train_fsdp.py (FSDP2 HSDP 2x2); pp: train_3d.py (PP2 x DP2)")
    p.add_argument("--optimizer", choices=("plain", "sharded"), default="plain",
                   help="train_gpt.py's --optimizer (the ddp and fsdp examples use AdamW)")
    p.add_argument("--run-timeout-s", type=float, default=240.0, help="a run still going after this is killed")
    p.add_argument("--hang-timeout-s", type=float, default=None,
                   help=f"{HANG}: unbroken run's --hang-timeout-s (default: the calibrated timeout)")
    p.add_argument("--rows", default=",".join(ROWS), metavar="NAME,...",
                   help="the rows to run, comma-separated (default: all)")
    p.add_argument("--json", default=None, help="write the figures here (BENCHMARKS.md layout)")
    p.add_argument("--verbose", action="store_true", help="echo every launcher's output")
    p.add_argument("--keep-logs", default=None, metavar="DIR",
                   help="write each run's stamped output to DIR/<nnn>-<row>.log")
    args = p.parse_args(argv)
    if not 0 < args.kill_step < args.steps:
        p.error(f"--kill-step must be in [1, {args.steps - 1}], got {args.kill_step}")
    unknown = sorted(set(args.rows.split(",")) - set(ROWS))
    if unknown:
        p.error(f"--rows: unknown row(s) {unknown}; allowed: {', '.join(ROWS)}")
    if args.ckpt_every < 1 or args.repeats < 1 or args.step_sleep_s < 0:
        p.error("--ckpt-every and --repeats must be >= 1, --step-sleep-s >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    skipped: dict[str, str] = {}
    memory_tier = has_memory_tier()
    if not memory_tier:
        skipped["unbroken_restart_memory"] = "n/a (memory tier not available in this version)"
    if importlib.util.find_spec("torchft") is None:
        skipped["torchft"] = "n/a (torchft not installed: skipped)"
    else:
        skipped["torchft"] = "n/a (torchft is installed, but this script has no torchft row yet: skipped)"
    for name in ("unbroken_restart_memory", "torchft"):
        if name in skipped:
            print(f"{name}: {skipped[name]}", flush=True)

    load_before = os.getloadavg()[0]
    workdir = Path(tempfile.mkdtemp(prefix="unbroken-recovery-bench-"))
    chosen = args.rows.split(",")
    results: dict[str, list[Run]] = {name: [] for name in ROWS if name not in skipped and name in chosen}
    try:
        bench = Bench(args, workdir, memory_tier)
        print("fault-free reference run ...", flush=True)
        reference = bench.reference_run()
        if not reference.ok:
            print(f"error: {'; '.join(reference.problems)}", file=sys.stderr)
            for line in reference.tail:
                print(f"    {line}", file=sys.stderr)
            return 1
        print(f"  job_s {reference.job_s:.1f}", flush=True)
        for rep in range(args.repeats):
            for name in results:
                print(f"repeat {rep + 1}/{args.repeats}: {name} ...", flush=True)
                run = bench.run_row(name)
                results[name].append(run)
                rec = "-" if run.recover_s is None else f"{run.recover_s:.2f}"
                job = "-" if run.job_s is None else f"{run.job_s:.1f}"
                print(f"  recover_s {rec}, lost_steps {run.lost_steps}, job_s {job}, "
                      f"weights {'equal' if run.weights_equal else 'DIFFER' if run.weights_equal is False else '?'}"
                      + (f"  PROBLEM: {'; '.join(run.problems)}" if run.problems else ""), flush=True)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        for popen in list(in_flight):
            kill_tree(popen)
        shutil.rmtree(workdir, ignore_errors=True)

    load_after = os.getloadavg()[0]
    print_table(args, results, skipped, reference)
    print(f"load average (1 min) before / after: {load_before:.1f} / {load_after:.1f} on {os.cpu_count()} cpus"
          " (other work on this machine moves absolute times; ratios of one run hold better)")
    if args.json:
        rows = [{"name": name, **summarize(runs)} for name, runs in results.items()]
        base = next((r.get("recover_s") for r in rows if r["name"] == IN_PLACE), None)
        for row in rows:
            if base and row.get("recover_s") is not None:
                row["recover_vs_in_place_ratio"] = round(row["recover_s"] / base, 3)
        rows.append({"name": "unbroken_no_fault_reference", "job_s": round(reference.job_s, 4)})
        doc = {"benchmark": "recovery",
               "params": {"script": args.script, "nproc": NPROC, "kill_rank": KILL_RANK, "steps": args.steps, "kill_step": args.kill_step,
                          "ckpt_every": args.ckpt_every, "repeats": args.repeats,
                          "step_sleep_s": args.step_sleep_s, "optimizer": args.optimizer,
                          "memory_tier_available": memory_tier},
               "machine": {"cpus": os.cpu_count(), "torch": torch.__version__,
                           "loadavg_1m_before": round(load_before, 2), "loadavg_1m_after": round(load_after, 2)},
               "skipped": skipped,
               "rows": rows}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
