"""Run generated scripts under `unbroken run`, send one fault from outside, judge the outcome.

A :class:`Case` is a combination (:class:`.render.Combo`) and a :class:`Fault`: SIGKILL or SIGSTOP of
the worker of one RANK (its pid from the run directory's latest ``rank_started`` event, else the
process whose environment has that ``RANK`` and the job's run dir), at one moment read from the
script's progress lines: ``before-first-step`` (the rank printed ``setup``: it has built everything
and is about to enter ``job.steps()``), ``mid`` (the rank began step k, 1 <= k <= STEPS - 2),
``last-step`` (it began the last step) or ``after-loop`` (its loop ended and it wrote its weights:
the fault hits ``job.close()`` and the exit; a kill between the loop and the script's own save would
take away a file only the script writes, which no recovery of training state can bring back).

Outcomes (:func:`judge`):

* ``pass``: exit 0 and every rank's final weights equal the fault-free run's bit for bit;
* ``refused``: the fault-free run of the combination is refused up front (:func:`refusal`);
* ``fail``: anything else, with its symptom: a timeout, a non-zero exit, a refusal that comes only
  with the fault or after a step, and exit 0 with missing or different weights (a silent difference).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tests.conftest import job_ids, ours, shm_files
from tests.integration.generator.render import STEPS, WRAPPERS, Combo, all_combos, render

REPO = Path(__file__).resolve().parents[3]
KINDS = ("SIGKILL", "SIGSTOP")
MOMENTS = ("before-first-step", "mid", "last-step", "after-loop")
#: Launcher flags of every run, fault-free or not (none changes the numbers). The first-step timeout
#: bounds a SIGSTOP before the first step when no rank has entered its loop yet (a stopped process
#: after that is found at the steady hang timeout). It is 90 s, above the default 60 s: under a load of
#: 15 on 2 cores, `import torch` plus AdamW's first import of torch._dynamo took over 70 s and a
#: fault-free run was killed as a hang three times (the generator judges results, not timing). Three
#: restarts are more than one fault needs; they bound a crash loop the crash-loop rule misses (issue 32,
#: case 5).
FLAGS = ["--first-step-timeout-s", "90", "--max-restarts", "3"]
REF_TIMEOUT_S = 240.0
EXIT_FATAL = 97
#: The line unbroken logs when it refuses something (unbroken/worker/session.py, EXIT_FATAL).
FATAL_LINE = re.compile(r"fatal error, exit code EXIT_FATAL=97 \(not restarted\): (\w+): (.*)")
EXCEPTION = re.compile(r"\b\w+(Error|Exception): |mismatch|[Tt]imed out")


@dataclass(frozen=True)
class Fault:
    kind: str  # SIGKILL or SIGSTOP
    moment: str  # one of MOMENTS
    rank: int
    step: int | None = None  # the step of a "mid" fault

    @property
    def key(self) -> str:
        return ":".join([self.kind, self.moment, f"rank{self.rank}", *([f"step{self.step}"] if self.step is not None else [])])

    @classmethod
    def parse(cls, key: str) -> "Fault":
        kind, moment, rank, *step = key.split(":")
        return cls(kind, moment, int(rank.removeprefix("rank")), int(step[0].removeprefix("step")) if step else None)

    def marker(self, steps: int = STEPS) -> str:
        """The progress line of the target rank that fires the fault."""
        what = {"before-first-step": "setup", "mid": f"step {self.step}", "last-step": f"step {steps - 1}",
                "after-loop": "saved"}[self.moment]
        return f"GEN rank={self.rank} {what}"


@dataclass(frozen=True)
class Case:
    combo: Combo
    fault: Fault

    @property
    def key(self) -> str:
        """``<combo key>@<fault key>``: replayed by ``python -m tests.integration.generator --case KEY``."""
        return f"{self.combo.key}@{self.fault.key}"

    @classmethod
    def parse(cls, key: str) -> "Case":
        combo, fault = key.split("@")
        return cls(Combo.parse(combo), Fault.parse(fault))


def sample(seed: int, count: int) -> list[Case]:
    """``count`` cases of distinct random combinations, each with a random fault. Case i's wrapper is
    ``WRAPPERS[i % 8]`` and its moment rotates, so that any 32 consecutive cases cover every wrapper
    and every moment; the rest (combination of that wrapper, kind, rank, step) is drawn from ``seed``."""
    rng = random.Random(seed)
    by_wrapper = {w: [c for c in all_combos() if c.wrapper == w] for w in WRAPPERS}
    for combos in by_wrapper.values():
        rng.shuffle(combos)
    cases = []
    for i in range(count):
        combos = by_wrapper[WRAPPERS[i % len(WRAPPERS)]]
        combo = combos[(i // len(WRAPPERS)) % len(combos)]
        moment = MOMENTS[(i + i // len(WRAPPERS)) % len(MOMENTS)]
        step = rng.randint(1, STEPS - 2) if moment == "mid" else None
        cases.append(Case(combo, Fault(rng.choice(KINDS), moment, rng.randrange(combo.nproc), step)))
    return cases


# -- running one job -----------------------------------------------------------------------------

@dataclass
class RunResult:
    returncode: int | None  # None: killed at its deadline
    output: str
    wall_s: float
    run_dir: Path
    out: Path
    nproc: int
    fired: str = ""  # what was sent to whom, "" when the fault never fired
    leftovers: list[str] = field(default_factory=list)  # what the job left behind after it exited by itself
    events: list[dict] = field(default_factory=list)

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def worker_pid(run_dir: Path, rank: int) -> int | None:
    """The pid of ``rank``'s current worker: its latest ``rank_started`` event, else the live process
    whose environment has ``RANK=rank`` and this job's run directory."""
    started = [e for e in read_events(run_dir) if e.get("event") == "rank_started" and e.get("rank") == rank]
    if started and psutil.pid_exists(started[-1]["pid"]):
        return started[-1]["pid"]
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        if env.get("RANK") == str(rank) and env.get("UNBROKEN_RUN_DIR") == str(run_dir):
            return proc.pid
    return None


def read_events(run_dir: Path) -> list[dict]:
    try:
        lines = (run_dir / "events.jsonl").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:  # the last line may be half written while the job runs
            pass
    return out


def _job_processes(run_dir: Path) -> list[psutil.Process]:
    procs = []
    for proc in psutil.process_iter():
        try:
            if ours(proc, str(run_dir)) and proc.status() != psutil.STATUS_ZOMBIE:
                procs.append(proc)
        except (psutil.Error, OSError):
            continue
    return procs


def cleanup(run_dir: Path, grace_s: float = 0.0) -> list[str]:
    """Kill whatever of this job is still alive (after ``grace_s``) and remove its /dev/shm files;
    returns what was left ("pid N", "/dev/shm/NAME")."""
    deadline = time.monotonic() + grace_s
    while (procs := _job_processes(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=5)
    left = [f"pid {p.pid}" for p in procs]
    for name in sorted(shm_files(job_ids(run_dir))):
        try:
            os.unlink(f"/dev/shm/{name}")
            left.append(f"/dev/shm/{name}")
        except FileNotFoundError:
            pass
    return left


def run_job(combo: Combo, work: Path, name: str, *, fault: Fault | None = None, timeout_s: float = REF_TIMEOUT_S,
            steps: int = STEPS) -> RunResult:
    """`unbroken run` the script of ``combo`` in ``work``; send ``fault`` when its marker line appears."""
    work.mkdir(parents=True, exist_ok=True)
    script, out, run_dir = work / "script.py", work / name, work / f"run-{name}"
    script.write_text(render(combo, steps))
    cmd = [sys.executable, "-m", "unbroken.cli.main", "run", "--nproc-per-node", str(combo.nproc),
           "--run-dir", str(run_dir), *FLAGS, str(script), str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    t0 = time.monotonic()
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
                           start_new_session=True)
    lines: list[str] = []
    seen = threading.Event()
    marker = fault.marker(steps) if fault else None

    def read() -> None:
        for line in job.stdout:
            lines.append(line)
            if marker and not seen.is_set() and line.rstrip().endswith(marker):
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    result = RunResult(None, "", 0.0, run_dir, out, combo.nproc)
    deadline = t0 + timeout_s
    try:
        if fault:
            while not seen.wait(0.01) and job.poll() is None and time.monotonic() < deadline:
                pass
            if seen.is_set():
                result.fired = _send(fault, run_dir)
        try:
            job.wait(timeout=max(0.0, deadline - time.monotonic()))
            result.returncode = job.returncode
        except subprocess.TimeoutExpired:
            pass
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        left = cleanup(run_dir, grace_s=3.0)
        if result.returncode is not None:  # after a deadline, what it left is ours to remove, not a finding
            result.leftovers = left
        reader.join(timeout=10)
    result.output, result.wall_s, result.events = "".join(lines), time.monotonic() - t0, read_events(run_dir)
    (work / f"{name}.log").write_text(result.output)  # the job's whole output, for a failure's post-mortem
    return result


def _send(fault: Fault, run_dir: Path) -> str:
    pid = worker_pid(run_dir, fault.rank)
    if pid is None:
        return ""
    try:
        os.kill(pid, getattr(signal, fault.kind))
    except ProcessLookupError:
        return ""
    return f"{fault.kind} to rank {fault.rank} (pid {pid})"


# -- judging ---------------------------------------------------------------------------------------

def refusal(result: RunResult) -> str | None:
    """The rule for "refused up front": the job exited with EXIT_FATAL (97), its output has unbroken's
    fatal line naming an unbroken error class (``... EXIT_FATAL=97 (not restarted): ConfigError: <what>``)
    and no step of the job was completed (no ``step`` record in its event log). Returns
    ``"<Class>: <message>"``, or None when the run was not refused up front."""
    import unbroken.errors as errors

    if result.returncode != EXIT_FATAL or any(e.get("event") == "step" for e in result.events):
        return None
    for match in FATAL_LINE.finditer(result.output):
        cls = getattr(errors, match.group(1), None)
        if isinstance(cls, type) and issubclass(cls, errors.UnbrokenError):
            return f"{match.group(1)}: {match.group(2).strip()[:200]}"
    return None


def weights(out: Path, nproc: int) -> dict[int, dict]:
    from safetensors.torch import load_file

    files = {r: Path(f"{out}.rank{r}.safetensors") for r in range(nproc)}
    return {r: load_file(str(p)) for r, p in files.items() if p.exists()}


def differing_ranks(ref: dict[int, dict], got: dict[int, dict]) -> dict[int, str]:
    """Rank -> what differs ("missing", or the first tensors that differ); empty when bit-equal."""
    diff = {}
    for rank, want in ref.items():
        have = got.get(rank)
        if have is None:
            diff[rank] = "missing"
            continue
        bad = [k for k in want if k not in have or want[k].dtype != have[k].dtype or want[k].shape != have[k].shape
               or not bool((want[k] == have[k]).all())] + sorted(set(have) - set(want))
        if bad:
            diff[rank] = ",".join(bad[:3]) + ("..." if len(bad) > 3 else "")
    return diff


def symptom(output: str) -> str:
    """The most telling lines of a failed run's output: the last exception line of a worker and the
    launcher's verdict (``unbroken: job failed ...``)."""
    lines = [line.strip() for line in output.splitlines()]
    errors = [line for line in lines if EXCEPTION.search(line) and not line.startswith("unbroken:")]
    verdict = [line for line in lines if line.startswith("unbroken: job")]
    parts = [errors[-1][:200]] if errors else []
    parts += [verdict[-1][:200]] if verdict else []
    return " / ".join(parts) or (lines[-1][:200] if lines else "(no output)")


def recovery_summary(events: list[dict]) -> str:
    """Rungs decided, in-flight recoveries and attempts, from the event log."""
    rungs: dict[str, int] = {}
    for e in events:
        if e.get("event") == "decision":
            rungs[e.get("rung", "?")] = rungs.get(e.get("rung", "?"), 0) + 1
    attempts = sum(1 for e in events if e.get("event") == "attempt_started")
    in_flight = sum(1 for e in events if e.get("event") == "recovered_in_flight")
    after = sum(1 for e in events if e.get("event") == "exited_after_loop")
    parts = [f"{r} x{n}" for r, n in sorted(rungs.items())]
    parts += [f"in-flight x{in_flight}"] if in_flight else []
    parts += [f"attempts {attempts}"] if attempts > 1 else []
    parts += [f"exited_after_loop x{after}"] if after else []
    return ", ".join(parts) or "no recovery"


@dataclass
class Outcome:
    case: Case
    result: str  # pass, refused, fail
    detail: str
    wall_s: float = 0.0


def judge(case: Case, ref: RunResult, got: RunResult | None) -> Outcome:
    """The outcome of ``case`` from its fault-free run ``ref`` and its faulty run ``got``."""
    refused = refusal(ref)
    if refused:
        return Outcome(case, "refused", refused)
    if ref.returncode == 0 and ref.leftovers:
        return Outcome(case, "fail", f"the fault-free run left behind {', '.join(ref.leftovers[:4])}")
    if ref.returncode != 0:
        return Outcome(case, "fail", f"the fault-free run failed (exit {ref.returncode}, {ref.wall_s:.0f} s): "
                                     f"{symptom(ref.output)}")
    assert got is not None
    how = f"{got.fired or 'fault never sent'}; {recovery_summary(got.events)}"
    if got.timed_out:
        last = [e for e in got.events if e.get("event") not in ("step", "metrics", "control_messages")][-1:]
        said = " ".join(f"{k}={v}" for k, v in last[0].items() if k != "t") if last else "no event"
        return Outcome(case, "fail", f"timed out after {got.wall_s:.0f} s ({how}); last event: {said[:160]}; "
                                     f"last output: {symptom(got.output)}", got.wall_s)
    if got.leftovers:
        return Outcome(case, "fail", f"exit {got.returncode} but left behind {', '.join(got.leftovers[:4])} ({how})",
                       got.wall_s)
    if refusal(got) or FATAL_LINE.search(got.output):
        return Outcome(case, "fail", f"refused only with the fault (exit {got.returncode}; {how}): "
                                     f"{symptom(got.output)}", got.wall_s)
    if got.returncode != 0:
        return Outcome(case, "fail", f"exit {got.returncode} ({how}): {symptom(got.output)}", got.wall_s)
    diff = differing_ranks(weights(ref.out, ref.nproc), weights(got.out, got.nproc))
    if diff:
        what = "; ".join(f"rank {r}: {d}" for r, d in sorted(diff.items()))
        kind = "weights missing" if all(d == "missing" for d in diff.values()) else "SILENT DIFFERENCE"
        return Outcome(case, "fail", f"exit 0 but {kind} ({how}): {what}", got.wall_s)
    return Outcome(case, "pass", how, got.wall_s)


class References:
    """Fault-free runs, one per combination, made on first use under ``root`` (shared by every case)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._runs: dict[str, RunResult] = {}

    def __call__(self, combo: Combo) -> RunResult:
        if combo.key not in self._runs:
            work = self.root / re.sub(r"[^A-Za-z0-9_.-]+", "_", combo.key)
            self._runs[combo.key] = run_job(combo, work, "reference")
        return self._runs[combo.key]


def run_case(case: Case, refs: References, work: Path) -> Outcome:
    """The fault-free run of the case's combination (cached), then its faulty run, judged."""
    ref = refs(case.combo)
    if ref.returncode != 0:
        return judge(case, ref, None)
    timeout_s = 2 * ref.wall_s + 120  # a SIGSTOP costs the hang timeout (<= 90 s before the first step)
    got = run_job(case.combo, work, "faulty", fault=case.fault, timeout_s=timeout_s)
    return judge(case, ref, got)
