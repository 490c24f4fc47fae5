"""The generator's command line: run sampled (or named) cases and print a table of their outcomes.

    python -m tests.integration.generator --seed 1 --count 60 --table       # the slow set's cases
    python -m tests.integration.generator --case 'ddp/bn/cursor/one-seed/sched@SIGKILL:mid:rank2:step3'
    python -m tests.integration.generator --default --table                  # the default run's sample
    python -m tests.integration.generator --list --seed 1 --count 60         # the cases, nothing run

Run from the repository root with the repository on PYTHONPATH. Each case's output goes under
``--work`` (a temporary directory unless given); ``--json FILE`` writes the outcomes as JSON lines.
Exit 0 when no case failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from tests.integration.generator.driver import Case, Outcome, References, run_case, sample
from tests.integration.generator.samples import DEFAULT_CASES, DEFAULT_SEED


def table(outcomes: list[Outcome]) -> str:
    """A Markdown table: combination x fault: outcome, detail."""
    rows = ["| # | combination | fault | outcome | s | detail |", "|---|---|---|---|---|---|"]
    for i, o in enumerate(outcomes):
        detail = o.detail.replace("|", "\\|")
        rows.append(f"| {i} | `{o.case.combo.key}` | {o.case.fault.key} | **{o.result}** | {o.wall_s:.0f} | {detail} |")
    counts = {r: sum(o.result == r for o in outcomes) for r in ("pass", "refused", "fail")}
    silent = sum("SILENT" in o.detail for o in outcomes)
    rows.append(f"\n{len(outcomes)} cases: {counts['pass']} pass, {counts['refused']} refused, "
                f"{counts['fail']} fail ({silent} silent differences)")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.integration.generator", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--count", type=int, default=60)
    p.add_argument("--start", type=int, default=0, help="skip the sample's first START cases")
    p.add_argument("--case", action="append", default=[], help="run this case (its key); repeatable")
    p.add_argument("--default", action="store_true", help="the default run's fixed sample")
    p.add_argument("--table", action="store_true", help="print the table at the end")
    p.add_argument("--list", action="store_true", help="print the cases and stop")
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.case:
        cases = [Case.parse(k) for k in args.case]
    elif args.default:
        cases = [Case.parse(k) for k in DEFAULT_CASES]
    else:
        cases = sample(args.seed, args.start + args.count)[args.start:]
        print(f"seed {args.seed}, cases {args.start}..{args.start + len(cases) - 1} "
              f"(UNBROKEN_GEN_SEED={args.seed} UNBROKEN_GEN_COUNT={args.start + args.count})", flush=True)
    if args.list:
        print("\n".join(c.key for c in cases))
        return 0
    work = args.work or Path(tempfile.mkdtemp(prefix="unbroken-gen-"))
    refs = References(work / "references")
    outcomes = []
    for i, case in enumerate(cases):
        t0 = time.monotonic()
        outcome = run_case(case, refs, work / f"case{args.start + i}")
        outcomes.append(outcome)
        print(f"[{args.start + i}] {outcome.result:7s} {case.key} ({time.monotonic() - t0:.0f} s): {outcome.detail}",
              flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({"i": args.start + i, "case": case.key, "result": outcome.result,
                                    "detail": outcome.detail, "wall_s": round(outcome.wall_s, 1)}) + "\n")
    if args.table:
        print(table(outcomes))
    print(f"work directory: {work}")
    return 1 if any(o.result == "fail" for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
