"""Scale benchmark: recovery time by world size, in flight vs a job-level restart (one machine).

    python benchmarks/scale.py                                   # N = 2, 4, 8, 16, 32; 3 repeats
    python benchmarks/scale.py --repeats 1 --plot docs/scale.png --markdown docs/scale.md

For each N, a tiny example GPT (examples/train_gpt.py, 1 layer, 32 wide, plain optimizer) trains
on N ranks and the last rank is SIGKILLed entering step --kill-step. Rows, interleaved per N:

  in_flight    `unbroken run` (recover-in-place): only the lost rank is replaced; components
               from the controller's `recovered_in_flight` event: detect_s (fault seen ->
               decided), replace_s (-> replacement joined), regroup_s (-> new group), restore_s
               (state transfer, slowest rank; a survivor's switch to the new groups is in it, and
               with --lazy-connect a survivor in no move waiting for the movers), other_s (what
               total_s holds besides: the reports reaching the controller, the last `resumed`),
               total_s (fault seen -> resumed); redo_s =
               recover_s - total_s (the time from resuming until back at the fault's step, plus
               the kill -> detection gap)
  in_flight_full_mesh  (not in the default rows) the same without `--lazy-connect` (the
               default): each generation's gloo groups connect every pair at the build, not a
               pair at its first message (comm/groups.py); in_flight passes `--lazy-connect`
  in_flight_prerun  (not in the default rows) in_flight with `--prerun-spares`: the replacement
               is a spare that ran the script up to its first rank-dependent read (the note
               says whether it took over or the rank started cold)
  job_restart  `unbroken run --recover-strategy exit` with the shared-memory tier (a snapshot
               every step): every rank restarts and loads the newest snapshot; total_s is the
               controller's recover_s (fault seen -> every rank back at the fault's step)

recover_s is, as in benchmarks/recovery.py, the "injecting fault" line -> the first completed
step >= --kill-step on rank 0's output. Medians of --repeats. This machine has 2 cores: at
N >> 2 every process waits for a core (start-up of N interpreters dominates a restart), so the
shape with N is what to read, not the absolute figures. Final weights are not compared here
(benchmarks/recovery.py does that at 4 ranks). A benchmark never asserts a time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_window import CpuSampler, cpu_by_role, format_cpu  # noqa: E402
from recovery_run import FAULT_RE, Run, add_event_figures, analyze, prerun_note  # noqa: E402 - the same measurement as recovery.py
from runlib import REPO, clean_shm, in_flight, kill_tree, launch, median, read_events, unbroken_cmd  # noqa: E402

EXAMPLE = REPO / "examples" / "train_gpt.py"
MODEL = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--batch-size", "4"]
COMPONENTS = ("detect_s", "replace_s", "regroup_s", "restore_s", "other_s", "redo_s", "total_s")
ROWS = ("in_flight", "job_restart", "in_flight_full_mesh", "in_flight_prerun")
DEFAULT_ROWS = ("in_flight", "job_restart")
EXTRA_TABLES = (("in_flight_full_mesh", "full mesh", "The same in flight with the full mesh (the default, no `--lazy-connect`)"),
                ("in_flight_prerun", "pre-run", "The same in flight with pre-run spares (`--prerun-spares`)"))


def command(row: str, nproc: int, d: Path, args: argparse.Namespace) -> list[str]:
    base = [*unbroken_cmd(), "run", "--nproc-per-node", str(nproc), "--run-dir", str(d / "run"),
            "--inject", f"kill:rank={nproc - 1}:step={args.kill_step}", "--first-step-timeout-s", "600"]
    if row in ("in_flight", "in_flight_prerun"):  # a gloo pair connects on its first message (the full mesh: the default)
        base += ["--lazy-connect"]
    if row == "in_flight_prerun":  # the replacement ran the script ahead (agent/prerun.py)
        base += ["--prerun-spares"]
    if row == "job_restart":
        base += ["--recover-strategy", "exit", "--save", str(d / "ckpt"), "--ckpt-every-steps", "1",
                 "--persist-every-steps", "1000"]
    return [*base, str(EXAMPLE), "--steps", str(args.steps), "--optimizer", "plain", "--log-every", "1",
            "--step-sleep-s", str(args.step_sleep_s), *MODEL]


def run_once(row: str, nproc: int, workdir: Path, args: argparse.Namespace, env: dict[str, str]) -> Run:
    d = Path(tempfile.mkdtemp(prefix=f"{row}-{nproc}-", dir=workdir))
    with CpuSampler() if args.cpu else contextlib.nullcontext() as sampler:
        res = launch(command(row, nproc, d, args), env, args.run_timeout_s, args.verbose)
    run = Run(row, job_s=res.job_s)
    analyze(run, res.lines, args.kill_step, args.steps)
    events = read_events(d / "run")
    add_event_figures(run, events)
    if row == "in_flight_prerun":
        run.notes.append(prerun_note(events, rank=nproc - 1))
    if sampler is not None:
        run.notes.extend(cpu_windows(sampler, run, res.lines, events, lost_rank=nproc - 1))
    if row.startswith("in_flight") and run.recover_s is not None and "total_s" in run.extra:
        run.extra["redo_s"] = max(0.0, run.recover_s - run.extra["total_s"])
        parts = [run.extra.get(k, 0.0) for k in ("detect_s", "replace_s", "regroup_s", "restore_s")]
        run.extra["other_s"] = max(0.0, run.extra["total_s"] - sum(parts))
    if row == "job_restart" and "controller_recover_s" in run.extra:
        run.extra["total_s"] = run.extra["controller_recover_s"]
    if res.timed_out or res.rc != 0:
        run.problems.append(f"exit {res.rc}, timed out {res.timed_out}")
        run.tail = [line for _, line in res.lines[-12:]]
    clean_shm(d / "run")
    shutil.rmtree(d, ignore_errors=True)
    return run


def cpu_windows(sampler: CpuSampler, run: Run, lines: list[tuple[float, str]], events: list[dict],
                lost_rank: int) -> list[str]:
    """CPU by role in three windows: the second before the fault (steady state), fault -> resumed
    (the controller's recovered_in_flight), resumed -> back at the fault's step (redo)."""
    fault_t = next((t for t, line in lines if FAULT_RE.search(line)), None)
    resumed_t = next((float(ev["t"]) for ev in events if ev.get("event") == "recovered_in_flight"), None)
    if fault_t is None or resumed_t is None or run.recover_s is None:
        return ["cpu: no fault, resume or recovery seen"]
    back_t = fault_t + run.recover_s
    windows = [("cpu steady (1 s before the fault)", fault_t - 1.0, fault_t), ("cpu fault -> resumed", fault_t, resumed_t),
               ("cpu resumed -> back at step", resumed_t, back_t)]
    return [format_cpu(label, cpu_by_role(sampler, t0, t1, fault_t, lost_rank)) for label, t0, t1 in windows]


def summarize(runs: list[Run]) -> dict[str, float]:
    out: dict[str, float] = {}
    good = [r for r in runs if r.recover_s is not None]
    if good:
        out["recover_s"] = median([r.recover_s for r in good])
    for key in COMPONENTS:
        vals = [r.extra[key] for r in good if key in r.extra]
        if vals:
            out[key] = median(vals)
    out["failed_runs"] = sum(not r.ok for r in runs)
    return out


def table(results: dict[int, dict[str, dict[str, float]]], args: argparse.Namespace, load: tuple[float, float]) -> str:
    head = " | ".join(["N ranks", *(f"in-flight {k}" for k in (*COMPONENTS, "recover_s")),
                       "job restart total_s", "job restart recover_s"])
    lines = [f"Recovery by world size: tiny GPT, kill the last rank at step {args.kill_step} of {args.steps}, "
             f"medians of {args.repeats} run(s); load {load[0]:.1f} -> {load[1]:.1f} on {os.cpu_count()} cpus", "",
             f"| {head} |", "|" + "---|" * (head.count("|") + 1)]
    fmt = lambda row, key: f"{row[key]:.3f}" if key in row else "-"  # noqa: E731
    for nproc, rows in sorted(results.items()):
        f, j = rows.get("in_flight", {}), rows.get("job_restart", {})
        cells = [str(nproc)] + [fmt(f, k) for k in (*COMPONENTS, "recover_s")] + [fmt(j, "total_s"), fmt(j, "recover_s")]
        failed = f.get("failed_runs", 0) + j.get("failed_runs", 0)
        lines.append("| " + " | ".join(cells) + " |" + (f" {failed:.0f} failed run(s)" if failed else ""))
    for row, label, title in EXTRA_TABLES:
        if not any(row in rows for rows in results.values()):
            continue
        head = " | ".join(["N ranks", *(f"{label} {k}" for k in (*COMPONENTS, "recover_s", "rp_script_s"))])
        lines += ["", f"{title} (interleaved with the rows above):", "", f"| {head} |", "|" + "---|" * (head.count("|") + 1)]
        for nproc, rows in sorted(results.items()):
            extra = rows.get(row, {})
            lines.append("| " + " | ".join([str(nproc)] + [fmt(extra, k) for k in (*COMPONENTS, "recover_s", "rp_script_s")]) + " |")
    return "\n".join(lines)


def plot(results: dict[int, dict[str, dict[str, float]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = sorted(results)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, style in zip(COMPONENTS, ("o:", "s:", "^:", "v-", "x:", "d:", "o-")):
        ys = [results[n].get("in_flight", {}).get(key) for n in ns]
        if any(y is not None for y in ys):
            ax.plot(ns, [float("nan") if y is None else y for y in ys], style, label=f"in flight: {key}")
    ys = [results[n].get("job_restart", {}).get("total_s") for n in ns]
    ax.plot(ns, [float("nan") if y is None else y for y in ys], "k-", lw=2, label="job restart: total_s")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("ranks (one 2-core machine)")
    ax.set_ylabel("seconds (log)")
    ax.set_title("unbroken: recovery of one lost rank by world size")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nprocs", default="2,4,8,16,32", help="world sizes, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="runs per (row, N); 1 for a quick run")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--kill-step", type=int, default=6)
    p.add_argument("--step-sleep-s", type=float, default=0.0)
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"comma-separated: {', '.join(ROWS)}")
    p.add_argument("--run-timeout-s", type=float, default=900.0)
    p.add_argument("--plot", default=None, metavar="PNG", help="write the plot here (needs matplotlib: the plot extra)")
    p.add_argument("--markdown", default=None, metavar="MD", help="write the table here")
    p.add_argument("--json", default=None)
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--cpu", action="store_true",
                   help="sample every process's CPU time and print it by role around the fault (benchmarks/cpu_window.py)")
    args = p.parse_args(argv)
    if args.repeats < 1 or not 0 < args.kill_step < args.steps:
        p.error(f"--repeats must be >= 1 and --kill-step in [1, {args.steps - 1}]")
    rows = args.rows.split(",")
    if set(rows) - set(ROWS):
        p.error(f"--rows: unknown {sorted(set(rows) - set(ROWS))}; allowed: {', '.join(ROWS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNBROKEN_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    workdir = Path(tempfile.mkdtemp(prefix="unbroken-scale-bench-"))
    load_before = os.getloadavg()[0]
    results: dict[int, dict[str, dict[str, float]]] = {}
    try:
        for nproc in [int(n) for n in args.nprocs.split(",")]:
            runs: dict[str, list[Run]] = {row: [] for row in args.rows.split(",")}
            for rep in range(args.repeats):
                for row in runs:
                    print(f"N={nproc} {row} repeat {rep + 1}/{args.repeats} ...", flush=True)
                    run = run_once(row, nproc, workdir, args, env)
                    runs[row].append(run)
                    print(f"  recover_s {run.recover_s}, {json.dumps({k: round(v, 3) for k, v in run.extra.items()})}"
                          + "".join(f"  ({note})" for note in run.notes if not note.startswith("cpu"))
                          + (f"  PROBLEM: {'; '.join(run.problems)}" if run.problems else ""), flush=True)
                    for line in [*(n for n in run.notes if n.startswith("cpu")), *run.tail]:
                        print(f"    {line}", flush=True)
            results[nproc] = {row: summarize(rs) for row, rs in runs.items()}
    except KeyboardInterrupt:
        print("interrupted: the table has the sizes done so far", file=sys.stderr)
    finally:
        for popen in list(in_flight):
            kill_tree(popen)
        shutil.rmtree(workdir, ignore_errors=True)
    text = table(results, args, (load_before, os.getloadavg()[0]))
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    if args.plot and results:
        plot(results, args.plot)
        print(f"wrote {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps({"benchmark": "scale", "params": vars(args),
                                               "rows": {str(n): r for n, r in results.items()}}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
