"""Node-loss benchmark: a node is lost and no standby waits. How long until the job trains again, how
many steps it redoes, how far its final weights are from the fault-free run's.

    sudo python benchmarks/node_loss.py [--steps 24] [--kill-after-step 8] [--json F]

Needs root (network namespaces: tests/netns/hosts.py) and the test extra. Every row runs the example
(examples/train_gpt.py, plain AdamW) on three "hosts" (namespaces on one bridge), one rank each; after
rank 0 printed step --kill-after-step, node 1 is killed (SIGKILL of every process of its host, its
memory tier gone with it). Rows:

  elastic_exact     `unbroken run --recover-strategy elastic,exit --elastic-mode exact`, memory tier
                    every step; the example with --exact-reduce (gradients summed in data-rank order):
                    the survivors run the lost rank's micro-batch too
  elastic_fast      the same with `--elastic-mode fast --elastic-lr-scaling linear` and a plain
                    all-reduce: a smaller global batch from the restart on
  elastic_scale_out elastic_exact, and node 1's agent started again on its host once the job shrank:
                    the job grows back to 3 ranks at a committed step (controller/elastic.py)
  torchrun_restart  the same loss under torchrun: `python -m torch.distributed.run --nnodes 2:3
                    --max-restarts 3 --rdzv-backend c10d` on each host (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1,
                    FACTS.md), default rendezvous timeouts; the example checkpoints to storage every
                    --ckpt-every steps (UNBROKEN_SAVE_DIR), which is what its restart can resume from

Figures, from the controller's host (node 0), each output line stamped with time.time() on arrival:
  recover_s      the kill -> the first completed step printed by rank 0 after it
  lost_steps     steps rank 0 completed again (printed twice)
  max_rel_diff   max over tensors of max|a - b| / max|b| of the final weights against a fault-free
                 `unbroken run` of the same script and flags on 3 ranks (0.0: bit-equal)
  scale_out_s    elastic_scale_out: node 1's agent started again -> every rank of the grown world back at
                 the step the scale-out was decided at (its `scaled_out` event); grow_s: that decision ->
                 the same point (the event's recover_s)
A benchmark never asserts a figure; it prints a table and, with --json, writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.conftest import EXAMPLE, REPO  # noqa: E402
from tests.integration.helpers import events, max_rel_diff  # noqa: E402
from tests.netns.hosts import Hosts  # noqa: E402
from tests.netns.job import PORT, SECRET, Agent, NetnsJob  # noqa: E402

NNODES = 3
STEP_RE = re.compile(r"^(?:\[rank 0\] )?step (\d+): loss ")
ROWS = ("elastic_exact", "elastic_fast", "elastic_scale_out", "torchrun_restart")


def script_args(a: argparse.Namespace, out: Path, *more: str) -> list[str]:
    return ["--steps", str(a.steps), "--out", str(out), "--optimizer", "plain", "--log-every", "1",
            "--step-sleep-s", str(a.step_sleep_s), *more]


def reference(a: argparse.Namespace, root: Path, *more: str) -> Path:
    """The fault-free run's final weights: `unbroken run` of 3 ranks on this host."""
    out = root / f"reference{''.join(more)}.safetensors"
    if out.exists():  # elastic_exact's, for elastic_scale_out
        return out
    cmd = [sys.executable, "-m", "unbroken.cli.main", "run", "--nproc-per-node", str(NNODES), "--run-dir",
           str(root / f"ref-run{''.join(more)}"), str(EXAMPLE), *script_args(a, out, *more)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=a.timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"the fault-free run failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return out


class Stamps:
    """Arrival times of rank 0's step lines in an agent's output, read by polling its lines."""

    def __init__(self, agent: Agent) -> None:
        self.agent, self.seen, self.steps = agent, 0, []  # steps: (time.time(), step)

    def poll(self) -> None:
        lines = self.agent.lines
        while self.seen < len(lines):
            m = STEP_RE.match(lines[self.seen].strip())
            if m:
                self.steps.append((time.time(), int(m[1])))
            self.seen += 1


def measure(a: argparse.Namespace, stamps: Stamps, hosts: Hosts, done, after_kill=None) -> dict:
    """Wait for step --kill-after-step, kill node 1, wait for the end; recover_s and lost_steps.
    ``after_kill``: polled after the kill until it returns True (elastic_scale_out starts node 1 again)."""
    deadline = time.monotonic() + a.timeout_s
    while not any(s >= a.kill_after_step for _, s in stamps.steps):
        stamps.poll()
        if time.monotonic() > deadline or done():
            raise RuntimeError(f"no step {a.kill_after_step} before the fault:\n{stamps.agent.output()}")
        time.sleep(0.01)
    kill_t = time.time()
    before = len(stamps.steps)
    hosts[1].kill()
    while not done() and time.monotonic() < deadline:
        stamps.poll()
        if after_kill is not None and after_kill():
            after_kill = None
        time.sleep(0.01)
    stamps.poll()
    after = [t for t, _ in stamps.steps[before:] if t > kill_t]
    counts: dict[int, int] = {}
    for _, s in stamps.steps:
        counts[s] = counts.get(s, 0) + 1
    return dict(recover_s=round(after[0] - kill_t, 3) if after else None,
                lost_steps=sum(c - 1 for c in counts.values()),
                completed=sorted(counts) == list(range(a.steps)))


def elastic_row(a: argparse.Namespace, root: Path, name: str, ref: Path) -> dict:
    d = root / name
    d.mkdir()
    exact = name != "elastic_fast"
    mode = ["--elastic-mode", "exact"] if exact else ["--elastic-mode", "fast", "--elastic-lr-scaling", "linear"]
    flags = ["--recover-strategy", "elastic,exit", "--node-reports", "--node-timeout-s", "5",
             "--first-step-timeout-s", "300", "--save", str(d / "save"), "--ckpt-every-steps", "1", *mode]
    hosts = Hosts.create(NNODES)
    try:
        extra = ["--step-sleep-s", str(a.step_sleep_s), "--log-every", "1", *(["--exact-reduce"] if exact else [])]
        job = NetnsJob(hosts, d, nnodes=NNODES, nproc=1, steps=a.steps, flags=flags, train_args=extra)
        back: list[float] = []  # elastic_scale_out: when node 1's agent was started again

        def come_back() -> bool:  # once the job shrank (its decision is logged)
            if not events(job.run_dir, "decision"):
                return False
            back.append(time.time())
            job.restart_agent(1)
            return True

        row = measure(a, Stamps(job.agents[0]), hosts, lambda: job.agents[0].popen.poll() is not None,
                      come_back if name == "elastic_scale_out" else None)
        code = job.agents[0].wait(60)
        row["exit_code"] = code
        row["max_rel_diff"] = max_rel_diff(job.out, ref) if code == 0 and job.out.exists() else None
        if name == "elastic_scale_out":
            scaled = events(job.run_dir, "scaled_out")
            row["scale_out_s"] = round(scaled[0]["t"] - back[0], 3) if scaled and back else None
            row["grow_s"] = scaled[0]["recover_s"] if scaled else None
            row["worlds"] = [e["to_world"] for e in events(job.run_dir, "scale_out")]
        return row
    finally:
        hosts.close()


def torchrun_row(a: argparse.Namespace, root: Path) -> dict:
    d = root / "torchrun_restart"
    d.mkdir()
    hosts = Hosts.create(NNODES)
    try:
        out = d / "weights.safetensors"
        agents = []
        for node in range(NNODES):
            h = hosts[node]
            env = dict(os.environ, **h.env(), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", UNBROKEN_JOB_SECRET=SECRET,
                       UNBROKEN_SAVE_DIR=str(d / "ckpt"), UNBROKEN_CKPT_EVERY_STEPS=str(a.ckpt_every))
            env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", f"2:{NNODES}", "--nproc-per-node", "1",
                   "--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-id", "node-loss",
                   "--rdzv-endpoint", f"{hosts[0].addr}:{PORT}", "--node-rank", str(node),
                   # node 0 hosts the rendezvous store: torchrun cannot tell from the endpoint inside a
                   # namespace (its hostname resolves to loopback)
                   "--rdzv-conf", f"is_host={'true' if node == 0 else 'false'}",
                   "--local-addr", h.addr,  # the workers' store (MASTER_ADDR) on this host's address
                   str(EXAMPLE), *script_args(a, out)]
            agents.append(Agent(h, cmd, env))
            if node == 0:
                time.sleep(0.5)
        row = measure(a, Stamps(agents[0]), hosts, lambda: agents[0].popen.poll() is not None)
        code = agents[0].wait(60)
        row["exit_code"] = code
        row["max_rel_diff"] = None  # a smaller world from its restart on, by design: not comparable
        if code != 0:
            row["tail"] = agents[0].output(1500)
        return row
    finally:
        hosts.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--kill-after-step", type=int, default=8)
    p.add_argument("--step-sleep-s", type=float, default=0.2)
    p.add_argument("--ckpt-every", type=int, default=5, help="torchrun_restart: storage checkpoint every K steps")
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--timeout-s", type=float, default=900)
    p.add_argument("--json", default=None, metavar="F")
    a = p.parse_args(argv)
    rows = [r.strip() for r in a.rows.split(",") if r.strip()]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        p.error(f"--rows: unknown {unknown} (allowed: {', '.join(ROWS)})")
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="node-loss-") as tmp:
        root = Path(tmp)
        for name in rows:
            t0 = time.monotonic()
            try:
                if name == "torchrun_restart":
                    results[name] = torchrun_row(a, root)
                else:
                    exact = name != "elastic_fast"
                    ref = reference(a, root, *(["--exact-reduce"] if exact else []))
                    results[name] = elastic_row(a, root, name, ref)
            except Exception as exc:  # noqa: BLE001  (a failed row is a row with its error, the others go on)
                results[name] = {"error": f"{type(exc).__name__}: {exc}"[-2000:]}
            results[name]["row_s"] = round(time.monotonic() - t0, 1)
            print(f"{name}: {results[name]}", flush=True)
    print(f"\n{'row':18} {'recover_s':>10} {'lost_steps':>10} {'max_rel_diff':>13} {'exit':>5} "
          f"{'scale_out_s':>11} {'grow_s':>7}")
    for name, r in results.items():
        diff = r.get("max_rel_diff")
        print(f"{name:18} {r.get('recover_s')!s:>10} {r.get('lost_steps')!s:>10} "
              f"{'-' if diff is None else f'{diff:.3g}':>13} {r.get('exit_code')!s:>5} "
              f"{r.get('scale_out_s', '-')!s:>11} {r.get('grow_s', '-')!s:>7}")
    if a.json:
        Path(a.json).write_text(json.dumps({"steps": a.steps, "kill_after_step": a.kill_after_step,
                                            "nnodes": NNODES, "rows": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
