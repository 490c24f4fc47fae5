"""Where the CPU goes during a recovery: per-process CPU time of a launcher's tree, by role.

Used by benchmarks/scale.py (``--cpu``). A :class:`CpuSampler` thread in the benchmark process
reads user + system CPU time of every descendant process (``psutil``, i.e. /proc/<pid>/stat)
every ``interval_s`` and names each process's role once: ``launcher`` (the `unbroken run`
process: controller + agent), ``rank <r>`` (a worker, from its RANK variable), ``spare`` (the
warm spare, `-m unbroken.agent.spare`; the one that existed before the fault becomes the
replacement). :func:`cpu_by_role` turns two sample times into CPU seconds per role over that
window; :func:`format_cpu` prints them with the share of the machine's cores they took.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import psutil


@dataclass
class Sample:
    t: float                                        # time.time()
    cpu_s: dict[int, float] = field(default_factory=dict)  # pid -> user + system seconds so far


class CpuSampler:
    """Samples the CPU time of every descendant of this process; runs in its own daemon thread."""

    def __init__(self, interval_s: float = 0.1) -> None:
        self.interval_s = interval_s
        self.samples: list[Sample] = []
        self.roles: dict[int, str] = {}       # pid -> role, named at first sight
        self.first_seen: dict[int, float] = {}
        self._procs: dict[int, psutil.Process] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-sampler", daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        me = psutil.Process(os.getpid())
        while not self._stop.is_set():
            sample = Sample(time.time())
            try:
                children = me.children(recursive=True)
            except psutil.Error:
                children = []
            for child in children:
                proc = self._procs.setdefault(child.pid, child)
                try:
                    times = proc.cpu_times()
                    sample.cpu_s[child.pid] = times.user + times.system
                    self.first_seen.setdefault(child.pid, sample.t)
                    if self.roles.get(child.pid, "other").startswith("other"):  # e.g. forked, not yet exec'd
                        self.roles[child.pid] = _role(proc)
                except psutil.Error:
                    continue
            self.samples.append(sample)
            self._stop.wait(self.interval_s)


def _role(proc: psutil.Process) -> str:
    cmd = " ".join(proc.cmdline())
    if "unbroken.agent.spare" in cmd:
        return "spare"
    try:
        name = proc.name()
    except psutil.Error:
        name = ""
    if name.startswith("unbroken-r"):  # forked by the node's zygote (agent/zygote.py)
        return f"rank {name[len('unbroken-r'):]}"
    if "unbroken.agent.zygote" in cmd:
        return "zygote"
    try:
        rank = proc.environ().get("RANK")
    except psutil.Error:
        rank = None
    if rank is not None:
        return f"rank {rank}"
    if " run " in f" {cmd} " and proc.ppid() == os.getpid():
        return "launcher"
    return f"other {cmd[:60]}"  # a child forked by the launcher is renamed once it has exec'd


def _at(samples: list[Sample], t: float) -> Sample:
    """The last sample taken at or before ``t`` (the first one if none)."""
    best = samples[0]
    for s in samples:
        if s.t > t:
            break
        best = s
    return best


def cpu_by_role(sampler: CpuSampler, t0: float, t1: float, fault_t: float, lost_rank: int) -> dict[str, float]:
    """CPU seconds per role between ``t0`` and ``t1`` (sample times, so +-interval_s). Roles:
    launcher, survivors (sum), survivor_max, lost (the killed rank's process), replacement (the
    spare present before ``fault_t``), new_spare (spares started after the fault), wall_s."""
    if not sampler.samples:
        return {}
    a, b = _at(sampler.samples, t0), _at(sampler.samples, t1)
    out: dict[str, float] = {"wall_s": b.t - a.t, "launcher": 0.0, "survivors": 0.0, "survivor_max": 0.0,
                             "lost": 0.0, "replacement": 0.0, "new_spare": 0.0}
    for pid, cpu in b.cpu_s.items():
        used = cpu - a.cpu_s.get(pid, 0.0)
        role = sampler.roles.get(pid, "other")
        if role == "spare":
            out["replacement" if sampler.first_seen[pid] < fault_t else "new_spare"] += used
        elif role == f"rank {lost_rank}":
            out["lost"] += used
        elif role.startswith("rank "):
            out["survivors"] += used
            out["survivor_max"] = max(out["survivor_max"], used)
        else:
            out[role] = out.get(role, 0.0) + used
    return out


def format_cpu(label: str, cpu: dict[str, float]) -> str:
    """One line: each role's CPU seconds and, for the total, the cores it kept busy."""
    if not cpu:
        return f"{label}: no samples"
    wall = max(cpu["wall_s"], 1e-9)
    total = sum(v for k, v in cpu.items() if k not in ("wall_s", "survivor_max"))
    parts = ", ".join(f"{k} {v:.3f}" for k, v in cpu.items() if k != "wall_s")
    return (f"{label}: wall {wall:.3f} s, CPU {total:.3f} s = {total / wall:.2f} of {os.cpu_count()} cores; "
            f"{parts}")
