"""Controller benchmark: the controller's own CPU per step and per recovery at 1k-16k ranks.

    python benchmarks/controller_scale.py                          # N = 1024 .. 16384, this tree
    python benchmarks/controller_scale.py --before-src DIR         # and a `git archive` of main, same run
    python benchmarks/controller_scale.py --nprocs 1024,4096 --repeats 5 --json out.json

What stays serial at any size is the controller: one process takes every rank's reports and
serves every rank's rendezvous store. On one 2-core machine N real ranks cannot be run at
these sizes, so this drives the controller's two N-dependent parts in this process, with the
real code and no sockets (the per-message wire cost, ~10-50 us, comes on top; docs/scale.md):

  commit     one step's commit: N StepSynced events through the job state machine
             (controller/machine.py `transition`), the last one committing
  recovery   one in-flight recovery: a rank exits at step 6 (5 committed), N - 1 survivors pause, the replacement
             joins (the regroup order), N ranks resume (back to RUNNING)
  start      N SessionReady events and N / 8 agents joining (a job's start, its restarts)
  store      one regroup's rendezvous with lazily connected groups on the controller's store
             (controller/store_service.py `StoreService.handle`): each rank sets its address,
             then asks for its ring neighbours' (half of them block until the key is set);
             the replies go to fake connections
  store_mesh the same with a full mesh (each rank gets every other rank's address), at N <= 1024
  handlers   one step through the real controller (a Controller built, not started): each rank's
             compute report and StepSynced as frames (msgpack, decode, the handler, the machine,
             the commit record; nothing goes back: the ranks commit by their own vote); the
             sockets' own cost is left out
  handlers_relayed  the same step with --node-reports: each node's 8 ranks' reports in one
             NodeReports (agent/relay.py)
  step       the controller's CPU for one steady step, the cheapest way it runs today: with node summaries
             (setting node_summaries, agent/held_reports.py) one NodeSummary per node (8 ranks a node) and
             the watchdog tick that takes them in (the commit record, the job step, the straggler rule);
             that is one step's share where steps take at least the summaries' interval (1 s), less for
             shorter steps. A tree without summaries: handlers_relayed. Its JSON record carries
             ``controller_cpu_per_step_s`` (issue 30's target: 5 ms at 16,384 ranks)
  node_floor the least a design with one message per node per step (8 ranks a node) could cost the controller:
             two msgpack frames per node per step (a node's compute and commit summaries: step, 8 ranks,
             8 pids, nothing per rank handled), unpacked and their ranks checked; no handler, no state
  watch      the controller's own periodic work for one second of that steady job, whatever the step rate:
             10 watchdog ticks (every WATCH_INTERVAL_S: node liveness, the hang rules, the after-loop rules)
             and one status.json rewrite (every STATUS_INTERVAL_S); JSON field ``controller_cpu_per_s``

Each row is timed in a fresh subprocess per tree (PYTHONPATH = the tree), medians of --repeats,
as the process's CPU time (time.process_time: what a loaded machine's other processes take is not counted);
"before" runs the same driver against --before-src. Printed: seconds per row and tree, per
rank, and before / ours. ``handlers``, ``handlers_relayed``, ``step``, ``watch`` and ``node_floor`` are not in the default rows (a heavier
setup); name them. A benchmark never asserts a time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from runlib import run_tree_driver  # noqa: E402  (benchmarks/ is not a package)
ROWS = ("commit", "recovery", "start", "store", "store_mesh", "handlers", "handlers_relayed", "step", "watch", "node_floor")
STEP_TARGET_S = 5e-3  # issue 30: controller CPU per step at 16,384 ranks
MESH_MAX_N = 1024

DRIVER = r'''
import json, sys, time
from unbroken.controller import machine as sm
from unbroken.controller.store_service import StoreService
from unbroken.protocol import messages as m

row, n, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
SUMMARIES = hasattr(m, "NodeSummary")  # a tree with node summaries (setting node_summaries)
TREE = hasattr(m, "GroupSummary")  # ... sent through a tree of agents (agent/summary_tree.py)

def started(n):
    state = sm.JobState(sm.JobPolicy(max_restarts=3, allowed=("recover-in-place", "recover", "exit")),
                        world_size=n, nnodes=max(1, n // 8))
    for node in range(state.nnodes):
        state, _ = sm.transition(state, sm.AgentJoined(node))
    for r in range(n):
        state, _ = sm.transition(state, sm.SessionReady(r, 0, 0))
    return state

def commit(state, n, step):
    events = [sm.StepSynced(r, 0, state.gen, step) for r in range(n)]
    t = time.process_time()
    for ev in events:
        state, actions = sm.transition(state, ev)
    dt = time.process_time() - t
    assert state.committed_step == step and actions, "the last report did not commit"
    return dt

def recovery(state, n):
    for r in range(n):  # step 5 committed; the fault hits step 6
        state, _ = sm.transition(state, sm.StepSynced(r, 0, state.gen, 5))
    events = [sm.RankExited(n - 1, 0, None, 9, step=6)]
    events += [sm.RankPaused(r, 0, 6, "compute") for r in range(n - 1)] + [sm.ReplacementJoined(n - 1, 0, 1)]
    events += [sm.RankResumed(r, 0, 1) for r in range(n)]
    t = time.process_time()
    for ev in events:
        state, actions = sm.transition(state, ev)
    dt = time.process_time() - t
    assert state.phase is sm.JobPhase.RUNNING and actions, "the recovery did not end"
    return dt

def start(n):
    t = time.process_time()
    state = started(n)
    dt = time.process_time() - t
    assert state.phase is sm.JobPhase.RUNNING
    return dt

class Conn:  # what the service needs of a connection: send(), closed
    closed = False
    def __init__(self): self.replies = 0
    def send(self, reply): self.replies += 1

def store(n, neighbours):
    svc = StoreService()
    svc.open_attempt(0)
    conns = [Conn() for _ in range(n)]
    ids = iter(range(1, 1 << 40))
    reqs = []
    for r in range(n):  # rank r publishes, then asks for its peers: the first half before the others published
        reqs.append((r, m.StoreRequest(id=next(ids), op="set", keys=[f"g1/addr/{r}"], values=[b"127.0.0.1:1234"])))
        for p in neighbours(r):
            reqs.append((r, m.StoreRequest(id=next(ids), op="get", keys=[f"g1/addr/{p}"], timeout_ms=60_000)))
    t = time.process_time()
    for r, req in reqs:
        for conn, reply in svc.handle(conns[r], 0, req):
            conn.send(reply)
    dt = time.process_time() - t
    want = sum(1 + len(neighbours(r)) for r in range(n))
    assert sum(c.replies for c in conns) == want, "not every request was answered"
    return dt

class WireConn:  # a worker's connection without the socket: what send() costs before sendall
    closed = False
    def __init__(self): self.sent = 0
    def send(self, msg):
        from unbroken.protocol.framing import pack_frame
        from unbroken.protocol.schema import encode
        pack_frame(encode(msg))
        self.sent += 1
    def send_packed(self, data):  # a broadcast, encoded once by the caller
        self.sent += 1

def handlers(n, relayed=False, watch=False, summarized=False):
    """One step through the real controller: each rank's compute report (and, where its tree sends one in a
    steady step of a data-parallel job, its StepSynced) as frames
    (msgpack unpack, decode, the handler, the state machine, the commit record; nothing is sent back:
    the ranks commit by their own vote). ``relayed``: the reports come as each node's NodeReports
    (8 ranks a node: agent/relay.py, --node-reports)."""
    import tempfile, msgpack
    from unbroken.config import LaunchConfig
    from unbroken.controller.connections import AGENT_HANDLERS, RANK_HANDLERS, Connections
    from unbroken.controller.eventlog import EventLog
    from unbroken.controller.server import Controller
    from unbroken.ops.live_view import LiveView
    from unbroken.protocol.framing import pack_frame
    from unbroken.protocol.schema import decode, encode
    run_dir = tempfile.mkdtemp(prefix="ctl-bench-")
    from unbroken.worker_config import WorkerSettings
    worker = WorkerSettings(node_summaries=True) if summarized else WorkerSettings()
    cfg = LaunchConfig(script="train.py", nproc_per_node=n, run_dir=run_dir, secret="bench-secret-" + "x1y2z3w4" * 4,
                       worker=worker)
    events = EventLog(run_dir)
    ctl = Controller(cfg, host="127.0.0.1", port=0, events=events)
    live = LiveView(run_dir=run_dir, job_id="bench", world_size=n, events=events, snapshot=ctl.snapshot)
    events.listeners.append(live.on_record)  # as the launcher joins them (agent/launcher.py), not started
    ctl.add_step_listener(live.on_step)
    if hasattr(ctl, "add_job_step_listener"):  # node summaries: the job step from them (launcher.py joins both)
        ctl.add_job_step_listener(live.on_job_step)
    ctl._state = started(n)  # mid-job, on n // 8 nodes: set directly (only apply() replaces it in a job)
    handling = Connections(ctl)  # the serving threads' handlers (no state of their own)
    per_node = n // ctl.state.nnodes
    conns = [WireConn() for _ in range(n)]
    agents = {a: WireConn() for a in range(ctl.state.nnodes)}
    for r in range(n):  # each rank's process started and registered (connections.py)
        ctl.board.process_started(r, 1000 + r, 0, time.monotonic())
        ctl.board.connected(r, conns[r], relayed=relayed)
    if relayed:
        for a, conn in agents.items():
            ctl.board.agent_joined(a, conn, standby=False)
    # A tree with the vote-less commit (worker/commit.py): a steady step of a job holding the whole state
    # on every rank sends one report per rank, its commit said by the next one (Progress.synced).
    ONE_REPORT = int("synced" in m.Progress.__dataclass_fields__)
    def reports(step):
        def metrics(r):  # what a session reports (worker/progress.py), the compute time feeding the straggler rule
            return {"loss": 1.0, "step_s": 0.5, "compute_s": 0.3 + r % 7 * 1e-3, "ckpt_s": 0.0}
        if ONE_REPORT:  # a step committed without a vote: its commit rides on the next compute report
            return [m.Progress(rank=r, attempt=0, step=step, phase="compute", metrics=metrics(r), state=b"s" * 64,
                               done=True, synced=True) for r in range(n)]
        return ([m.Progress(rank=r, attempt=0, step=step, phase="compute", metrics=metrics(r), state=b"s" * 64,
                            done=True) for r in range(n)]
                + [m.StepSynced(rank=r, attempt=0, gen=0, step=step, state=b"t" * 64) for r in range(n)])
    def frames(step):
        if summarized and TREE:  # each group's leader: its nodes' summaries as columns (agent/summary_tree.py)
            from unbroken.agent.summary_tree import FANOUT
            ids = sorted(agents)
            return [(g[0], pack_frame(encode(m.GroupSummary(
                agents=g, attempts=[0] * len(g), nranks=[per_node] * len(g), done=[step] * len(g),
                age_s=[0.05] * len(g), step_s=0.5, ckpt_s=0.0, compute_s=[0.3] * len(g),
                slow_rank=[a * per_node for a in g], slow_s=[0.3 + a % 7 * 1e-3 for a in g]))))
                    for g in (ids[i:i + FANOUT] for i in range(0, len(ids), FANOUT))]
        if summarized:  # a node's summary: its ranks completed `step` steps (agent/held_reports.py)
            return [(a, pack_frame(encode(m.NodeSummary(attempt=0, nranks=per_node, done=step, age_s=0.05,
                                                         step_s=0.5, ckpt_s=0.0, compute_s=0.3, slow_rank=a * per_node,
                                                         slow_s=0.3 + a % 7 * 1e-3))))
                    for a in agents]
        msgs = reports(step)
        if not relayed:
            return [(msg.rank, pack_frame(encode(msg))) for msg in msgs]
        batches = [msgs[i:i + per_node] for i in range(0, len(msgs), per_node)]
        return [(b[0].rank // per_node, pack_frame(encode(m.NodeReports(entries=[encode(x) for x in b],
                                                                         pids=[1000 + x.rank for x in b]))))
                for b in batches]
    def feed(work):
        for who, frame in work:
            msg = decode(msgpack.unpackb(frame[4:], raw=False))
            with ctl.lock:
                if relayed:
                    AGENT_HANDLERS[type(msg)](handling, who, msg)
                else:
                    RANK_HANDLERS[type(msg)](handling, who, 0, conns[who], msg)
        if summarized:
            with ctl.lock:
                ctl._take_summaries()  # the watchdog's tick: what the summaries say of the job
    from unbroken.controller.health import WINDOW
    for step in range(1, WINDOW + 2):  # warm: the imports, and every rank's compute times for the straggler rule
        feed(frames(step))
    work = frames(WINDOW + 2)
    t = time.process_time()
    feed(work)
    dt = time.process_time() - t
    want = WINDOW + 1 if summarized else WINDOW + 2 - ONE_REPORT
    assert ctl.state.committed_step == want, "the controller did not record the step committed"
    if not watch:
        return dt
    from unbroken.controller.watchdog import WATCH_INTERVAL_S
    from unbroken.ops.live_view import STATUS_INTERVAL_S
    ticks = round(1.0 / WATCH_INTERVAL_S)
    t = time.process_time()
    for i in range(ticks):  # one second of the watchdog thread (server.py _watch_loop), every agent heard
        now = time.monotonic()
        for a in agents:
            ctl.liveness.heard(a, now)
        ctl._check_nodes(now)
        with ctl.lock:
            ctl._check_after_loop(now)
            ctl._check_hangs(now)
    for _ in range(round(1.0 / STATUS_INTERVAL_S)):  # the live view's status thread (ops/live_view.py)
        live._write_status()
    dt = time.process_time() - t
    assert not ctl.state.hung_ranks, "the watchdog blamed a rank of a steady job"
    return dt

def node_floor(n):
    import msgpack
    nodes = max(1, n // 8)
    frames = [msgpack.packb({"type": kind, "attempt": 0, "gen": 0, "step": 12, "ranks": list(range(a * 8, a * 8 + 8)),
                             "pids": list(range(1000 + a * 8, 1008 + a * 8))})
              for a in range(nodes) for kind in ("node_compute", "node_synced")]
    t = time.process_time()
    for f in frames:
        d = msgpack.unpackb(f, raw=False)
        if not (all(type(r) is int for r in d["ranks"]) and all(type(p) is int for p in d["pids"])):
            raise SystemExit("bad frame")
    return time.process_time() - t

def run_once():
    if row == "commit":
        return commit(started(n), n, 5)
    if row == "recovery":
        return recovery(started(n), n)
    if row == "start":
        return start(n)
    if row == "handlers":
        return handlers(n)
    if row == "handlers_relayed":
        return handlers(n, relayed=True)
    if row == "step":
        return handlers(n, relayed=True, summarized=SUMMARIES)
    if row == "watch":
        return handlers(n, relayed=True, watch=True, summarized=SUMMARIES)
    if row == "node_floor":
        return node_floor(n)
    if row == "store":
        return store(n, lambda r: [(r - 1) % n, (r + 1) % n])
    if row == "store_mesh":
        return store(n, lambda r: [p for p in range(n) if p != r])
    raise SystemExit(f"unknown row {row!r}")

print(json.dumps([run_once() for _ in range(repeats)]))
'''


def measure(src: Path, row: str, n: int, repeats: int, timeout_s: float) -> float | None:
    times = run_tree_driver(src, DRIVER, [row, str(n), str(repeats)], timeout_s, f"{row} N={n}")
    return None if times is None else statistics.median(times)


def fmt(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.1f} ms" if s < 10 else f"{s:.1f} s"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nprocs", default="1024,2048,4096,8192,16384", help="world sizes, comma-separated")
    p.add_argument("--rows", default=",".join(ROWS[:-5]), help=f"comma-separated: {', '.join(ROWS)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--before-src", default="", help="also time this source tree (e.g. a git archive of main)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per row, tree and N")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    sizes = [int(x) for x in args.nprocs.split(",") if x]
    rows = [r for r in args.rows.split(",") if r]
    if bad := [r for r in rows if r not in ROWS]:
        p.error(f"unknown row(s) {bad} (allowed: {', '.join(ROWS)})")
    trees = [("ours", REPO)] + ([("before", Path(args.before_src).resolve())] if args.before_src else [])
    results: list[dict] = []
    for row in rows:
        for n in sizes:
            if row == "store_mesh" and n > MESH_MAX_N:
                continue
            rec = {"row": row, "n": n}
            for name, src in trees:
                rec[name] = measure(src, row, n, args.repeats, args.timeout_s)
            if row == "step":
                rec["controller_cpu_per_step_s"] = rec["ours"]
            if row == "watch":
                rec["controller_cpu_per_s"] = rec["ours"]
            results.append(rec)
            print(f"  {row} N={n}: " + ", ".join(f"{name} {fmt(rec[name])}" for name, _ in trees), file=sys.stderr)
    head = "| row | N ranks | ours | ours per rank |" + (" before | before / ours |" if args.before_src else "")
    print(f"\nController CPU by world size (this process, no sockets), medians of {args.repeats}\n")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for rec in results:
        ours, before = rec["ours"], rec.get("before")
        line = f"| {rec['row']} | {rec['n']} | {fmt(ours)} | " + (f"{ours / rec['n'] * 1e6:.1f} us |" if ours else "- |")
        if args.before_src:
            ratio = f"{before / ours:.1f}x" if ours and before else "-"
            line += f" {fmt(before)} | {ratio} |"
        print(line)
    for rec in results:
        if rec["row"] == "step" and rec["ours"] is not None:
            met = "met" if rec["ours"] <= STEP_TARGET_S else "NOT met"
            print(f"\nstep at N={rec['n']}: controller CPU {fmt(rec['ours'])} per step "
                  f"(target {fmt(STEP_TARGET_S)} at 16384 ranks: {met} at this N)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
