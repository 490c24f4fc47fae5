"""One benchmark launch read as figures: steps lost, recover_s, the controller's recovery components,
the restore phases, the final weights. Shared by benchmarks/recovery.py and benchmarks/scale.py
(scripts run from the repository, so this module is importable as `recovery_run`)."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

NPROC = 4  # recovery.py's ranks: train_3d.py writes one weights file per rank
KILL_RANK = 2  # the rank recovery.py's rows kill or stop


# A completed step of rank 0: "step N: loss ..." (under torchrun only rank 0 prints). train_3d.py's
# rank 0 is stage 0, which has no loss: "step N: 12.3 ms" (its last stage prints loss lines too,
# unprefixed under torchrun: they are not rank 0's)
STEP_RE = re.compile(r"^(?:\[rank (\d+)\] )?step (\d+): loss ")
STEP_RES = {"pp": re.compile(r"^(?:\[rank (\d+)\] )?step (\d+): [\d.]+ ms")}
FAULT_RE = re.compile(r"injecting fault (\S+)")


# -----------------------------------------------------------------------------------------
# What a run measured.

@dataclass
class Run:
    name: str
    recover_s: float | None = None
    lost_steps: int | None = None
    job_s: float | None = None
    weights_equal: bool | None = None
    timed_out: bool = False
    extra: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    tail: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def analyze(run: Run, lines: list[tuple[float, str]], kill_step: int, steps: int,
            fault_t: float | None = None, step_re: re.Pattern = STEP_RE) -> None:
    """recover_s and lost_steps from the stamped output (see the module docstring); ``fault_t``:
    when the benchmark itself made the fault (the hang row's SIGSTOP), else the fault's line."""
    recovered_t: float | None = None
    done: Counter[int] = Counter()
    first_after_fault: int | None = None
    for t, line in lines:
        if fault_t is None and FAULT_RE.search(line):
            fault_t = t
            continue
        m = step_re.match(line)
        if not m or m[1] not in (None, "0"):
            continue
        index = int(m[2])  # printed inside `with job.step():`: a completed step only
        done[index] += 1
        if fault_t is not None and first_after_fault is None and (index >= kill_step or done[index] > 1):
            first_after_fault = index  # where training resumed (a late line of step K-1 is not it)
        if fault_t is not None and recovered_t is None and index >= kill_step:
            recovered_t = t
    if fault_t is None:
        run.problems.append("no 'injecting fault' line (or SIGSTOP): the fault did not fire")
    elif recovered_t is None:
        run.problems.append(f"no completed step >= {kill_step} after the fault")
    else:
        run.recover_s = recovered_t - fault_t
    missing = [s for s in range(steps) if not done[s]]
    if missing:
        run.problems.append(f"steps never completed: {missing[:10]}{' ...' if len(missing) > 10 else ''}")
    run.lost_steps = sum(c - 1 for c in done.values())
    if first_after_fault is not None:
        run.extra["resume_step"] = first_after_fault


def add_event_figures(run: Run, events: list[dict], stop_t: float | None = None) -> None:
    """The controller's figures; for the hang row (``stop_t``: when the rank was SIGSTOPped) also
    the hang timeout it used and hang_detect_s, SIGSTOP -> its ``hang_detected`` event."""
    for ev in events:
        if ev.get("event") == "hang_detected" and stop_t is not None and "hang_timeout_s" not in run.extra:
            run.extra["hang_timeout_s"] = float(ev["timeout_s"])
            run.extra["hang_detect_s"] = float(ev["t"]) - stop_t
            if ev.get("rank") != KILL_RANK:  # a victim blamed: the detector's one unforgivable mistake
                run.problems.append(f"hang blamed on rank {ev.get('rank')}, not the SIGSTOPped rank {KILL_RANK}")
        if ev.get("event") == "recovered" and "controller_recover_s" not in run.extra:
            run.extra["controller_recover_s"] = float(ev["recover_s"])
            run.notes.append(f"{ev.get('tier')}, step {ev.get('restored_step')}")
        elif ev.get("event") == "recovered_in_flight" and "total_s" not in run.extra:
            for key in ("detect_s", "replace_s", "regroup_s", "restore_s", "total_s"):
                if key in ev:
                    run.extra[key] = float(ev[key])
    add_restore_phases(run, [ev for ev in events if ev.get("event") == "restore_phases"])


def prerun_note(events: list[dict], rank: int = KILL_RANK) -> str:
    """Whether the killed rank's replacement was the pre-run spare (ready before the fault) or not."""
    ready = {ev["pid"]: ev.get("where") for ev in events if ev.get("event") == "spare_ready"}
    starts = [ev["pid"] for ev in events if ev.get("event") == "rank_started" and ev.get("rank") == rank]
    if starts[1:] and starts[-1] in ready:
        return f"pre-run spare (blocked at {ready[starts[-1]]})"
    failed = [ev for ev in events if ev.get("event") == "prerun_failed"]
    return "pre-run spare FAILED: warm spare" if failed else "pre-run spare not ready at the fault: cold start"


def add_restore_phases(run: Run, phases: list[dict]) -> None:
    """Where the first in-flight recovery's restore_s went (the workers' ``restore_phases`` events):
    the replacement's own script between init() and job.steps() (``rp_script_s``), its receive
    rounds and its loads; the survivors' longest restore (they wait for the replacement)."""
    first = [ev for ev in phases if ev.get("gen") == min((e.get("gen", 0) for e in phases), default=0)]
    new = [ev for ev in first if ev.get("role") == "replacement"]
    if new:
        ev = new[0]
        run.extra["rp_replacement_s"] = float(ev.get("restore_s", 0.0))
        run.extra["rp_script_s"] = float(ev.get("script_s", 0.0))
        run.extra["rp_receive_s"] = sum(float(ev.get(k, 0.0)) for k in ("x_headers_s", "x_bodies_s", "x_large_s"))
        run.extra["rp_load_s"] = float(ev.get("load_s", 0.0)) + float(ev.get("x_unpack_s", 0.0))
    survivors = [float(ev.get("restore_s", 0.0)) for ev in first if ev.get("role") == "survivor"]
    if survivors:
        run.extra["rp_survivor_max_s"] = max(survivors)


def load_weights(out: Path, script: str) -> dict | None:
    """A run's final weights ({name: tensor}); train_3d.py writes one file per rank (its stage):
    all of them, keys prefixed by the rank. None when a file is missing."""
    from safetensors.torch import load_file

    if script != "pp":
        return load_file(str(out)) if out.exists() else None
    files = [out.with_name(f"{out.stem}.rank{r}{out.suffix}") for r in range(NPROC)]
    if not all(f.exists() for f in files):
        return None
    return {f"rank{r}/{k}": v for r, f in enumerate(files) for k, v in load_file(str(f)).items()}


def same_weights(got: dict, reference: dict) -> bool:
    import torch

    return got.keys() == reference.keys() and all(torch.equal(got[k], reference[k]) for k in got)
