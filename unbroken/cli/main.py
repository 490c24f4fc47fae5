"""The `unbroken` command line: `run`, `demo`, `ckpt`, `status`, `report`. The only place that prints.

Usage errors exit with code 2 and a message naming the flag, the value and what is allowed.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import signal
import sys
from pathlib import Path
from typing import Sequence

from unbroken.config import HangConfig, LaunchConfig, parse_strategies, secret_from_env
from unbroken.errors import ConfigError, UnbrokenError
from unbroken.recovery.policy import JobPolicy
from unbroken.worker_config import CheckpointConfig, WorkerSettings, setting_flag


class Parser(argparse.ArgumentParser):
    """Our parsers: usage errors exit with code 2, and a flag is never matched by abbreviation.

    ``launches_script`` (`unbroken run`): the launcher's flags come before the script path; the
    first word that is not one of them (or its value) is the script, and every word after it is the
    script's, passed on untouched, even one spelled like a launcher flag (as torchrun does).
    """

    def __init__(self, *args, launches_script: bool = False, **kwargs) -> None:
        super().__init__(*args, allow_abbrev=False, **kwargs)
        self._launches_script = launches_script

    def error(self, message: str) -> None:  # argparse's own usage errors: exit code 2
        self.print_usage(sys.stderr)
        self.exit(2, f"unbroken: error: {message}\n")

    def parse_known_args(self, args=None, namespace=None):
        if not self._launches_script:
            return super().parse_known_args(args, namespace)
        words = list(sys.argv[1:] if args is None else args)
        cut = self._script_index(words)
        if words[cut:cut + 1] == ["--"]:  # `unbroken run [flags] -- script.py ...`
            del words[cut]
        namespace, extra = super().parse_known_args(words[:cut + 1], namespace)
        namespace.script_args = words[cut + 1:]
        return namespace, extra

    def _script_index(self, words: list[str]) -> int:
        """Index of the script path in ``words``, or of a ``--`` before it (len(words): none; argparse
        then says so)."""
        i = 0
        while i < len(words):
            word = words[i]
            if word == "--" or not word.startswith("-") or word == "-":
                return i
            name, has_value, _ = word.partition("=")
            action = self._option_string_actions.get(name)
            if action is None:
                self.error(f"unknown flag {name} before the script: the launcher's flags are spelled out in full "
                           "(see `unbroken run --help`); the script's own flags go after the script path")
            i += 1 if has_value or action.nargs == 0 else 2
        return len(words)


def _int(text: str) -> int:
    """Any integer: the range of each flag is checked once, by its config dataclass (a message
    that names the flag, the value and what is allowed)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def _nnodes(text: str) -> int:
    if ":" in text:
        raise argparse.ArgumentTypeError(
            f"{text!r}: elastic node ranges are not supported; give a fixed number of nodes")
    return _int(text)


def add_run_flags(p: argparse.ArgumentParser) -> None:
    # torchrun's flags, in both spellings (--nproc-per-node and --nproc_per_node).
    def flag(name: str, **kw) -> None:
        names = [f"--{name}"] + ([f"--{name.replace('-', '_')}"] if "-" in name else [])
        p.add_argument(*names, **kw)

    flag("nproc-per-node", type=_int, default=1, help="worker processes on this node")
    flag("nnodes", type=_nnodes, default=1, help="number of nodes (one `unbroken run` per node)")
    flag("node-rank", type=_int, default=0, help="this node's index")
    flag("master-addr", default="127.0.0.1", help="node 0's address (controller)")
    flag("master-port", type=_int, default=0, help="controller port on node 0 (0: a free one)")
    flag("max-restarts", type=_int, default=32767, help="job restarts allowed (default 32767)")
    flag("standalone", action="store_true", help="accepted for torchrun compatibility (single node)")
    flag("rdzv-endpoint", default=None, help="torchrun-style HOST:PORT of node 0")
    flag("rdzv-id", default="", help="job id (torchrun-style)")
    flag("rdzv-backend", default="c10d", help="accepted for torchrun compatibility")
    flag("monitor-interval", type=_float, default=None, help="accepted for torchrun compatibility")
    flag("run-dir", default=None, help="run directory: event log, config (default runs/<job-id>)")
    flag("save", default=None, metavar="DIR", help="write checkpoints to DIR")
    flag("load", default=None, metavar="DIR", help="resume from the newest complete checkpoint in DIR")
    flag("ckpt-every-steps", type=_int, default=None,
         help="shared-memory snapshot every K steps (default with --save: 1; 0: none)")
    flag("persist-every-steps", type=_int, default=None,
         help="storage checkpoint every K steps, written by the agent in the background "
              "(default with --save: max(10, --ckpt-every-steps); 0: none)")
    flag("keep-checkpoints", type=_int, default=3, help="committed checkpoints kept")
    flag("shm-dir", default="/dev/shm", metavar="DIR",
         help="tmpfs directory of the shared-memory snapshots (default /dev/shm); checked to fit before step 0")
    flag("no-peer-memory", action="store_true",
         help="keep no copy of this node's newest snapshots in another node's memory (default: kept, so a lost "
              "node restores from memory, not storage)")
    flag("inject", default="", metavar="PLAN", help="faults to inject, e.g. kill:rank=2:step=30")
    flag("recover-strategy", default="retry,recover-in-place,recover,exit",
         help="allowed recovery strategies, cheapest first, a comma list (default retry,recover-in-place,recover,exit)")
    flag("standby", action="store_true", help="join a running job as a spare agent (rung `recover`)")
    flag("no-replica-restore", action="store_true",
         help="never restore a lost rank from replicas; recover from the newest checkpoint instead")
    flag("elastic-mode", default="exact", metavar="MODE",
         help="rung `elastic` (in --recover-strategy): a node lost and no standby, the job goes on on the nodes "
              "left. exact (default): same global batch and sample order (the script splits its batch by "
              "job.data_ranks()); fast: a smaller global batch")
    flag("min-nodes", type=_int, default=1, help="rung `elastic` never shrinks the job below this many nodes")
    flag("elastic-lr-scaling", default="none", metavar="RULE",
         help="--elastic-mode fast: the factor job.lr_scale hands the script, none (1), linear (new/original "
              "data-parallel ranks) or sqrt (its square root)")
    flag("no-scale-out", action="store_true",
         help="rung `elastic`: a shrunk job never grows back (default: once every node of the launch is there "
              "again, the lost one back or a standby agent, it grows back to its launch size at a committed step)")
    flag("no-fork-ranks", action="store_true",
         help="start every rank as its own `python script` process instead of forking it from the node's "
              "zygote, a process that imported torch once (see docs/recovery.md)")
    flag("pool-socket", default="", metavar="PATH",
         help="fork the ranks from the pool listening on PATH (`unbroken pool`: torch imported before the launch); "
              "default: the default pool socket, used when a pool listens there (see docs/recovery.md)")
    flag("prerun-spares", action="store_true",
         help="spares run the script up to its first rank-dependent read before a rank is lost (see docs/recovery.md)")
    _add_worker_settings(flag)
    flag("crash-loop-limit", type=_int, default=3,
         help="fail the job when the same rank fails the same way (exit status, step, last output line) "
              "this many times in a row (default 3; 0: restart up to --max-restarts)")
    flag("max-recurring-recoveries", type=_int, default=2,
         help="an in-flight recovery holds once every rank completed the step it resumed; a rank failing "
              "before that is the same fault recurring: after this many in-flight recoveries of it, the job "
              "restarts from its newest checkpoint instead (default 2)")
    flag("straggler-factor", type=_float, default=0.0,
         help="report a rank degraded (sub-health) when its median compute time over its last 10 steps "
              "is more than F times the job's median (default 0: off)")
    flag("sub-health-policy", choices=["ignore", "grace-exit"], default="ignore",
         help="a rank reported degraded: ignore it, or dump the state and restart cleanly (default ignore)")
    flag("metrics-port", type=_int, default=None, metavar="PORT",
         help="serve Prometheus /metrics, /status.json and a live page on PORT of --master-addr "
              "(node 0; default: off; 0: a free port, written to the event log)")
    flag("sigterm-dump-timeout-s", type=_float, default=20.0, metavar="S",
         help="on SIGTERM with --save, the time the job has to dump its newest committed step to --save "
              "before it stops without it (default 20: Kubernetes' terminationGracePeriodSeconds, 30 s by "
              "default, must be at least this + 10 s; 0: no dump)")
    flag("node-timeout-s", type=_float, default=30.0, metavar="S",
         help="a node silent this long (frozen, link cut) is lost to the job; a node that hears nothing "
              "from the controller for half of it stops its own workers and exits (fencing; default 30)")
    flag("controller-store", default="", metavar="etcd://HOST:PORT[,HOST:PORT...]",
         help="keep the controller's state in etcd and let any agent of a multi-node job take the controller "
              "over when its node is lost (default: off; the controller lives in node 0's agent). Needs --rdzv-id")
    flag("controller-lease-s", type=_int, default=2, metavar="S",
         help="with --controller-store: the leading controller's lease; a new one leads within about this "
              "long after the leader is lost (whole seconds, default 2)")
    flag("hang-timeout-s", type=_float, default=None, help="fixed hang timeout (default: calibrated)")
    flag("first-step-timeout-s", type=_float, default=60.0, help="hang timeout before a rank's first step")
    flag("exit-timeout-s", type=_float, default=300.0, metavar="S",
         help="a rank past its step loop still running this long after every other rank exited is hung "
              "there: killed, and the job ends as the finished ranks left it (default 300)")
    p.add_argument("script", help="training script")
    p.add_argument("script_args", nargs="*", metavar="ARG", help="its arguments, passed on untouched")


def _add_worker_settings(flag) -> None:
    """One flag per field of WorkerSettings (its name, type, default and help come from the field)."""
    for f in dataclasses.fields(WorkerSettings):
        if isinstance(f.default, bool):
            action = "store_false" if f.default else "store_true"
            flag(setting_flag(f), action=action, dest=f.name, help=f.metadata["help"])
        else:
            kind = _int if isinstance(f.default, int) else _float
            flag(setting_flag(f), type=kind, default=f.default, dest=f.name, help=f.metadata["help"])


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="unbroken", description="Keeps distributed PyTorch training running through failures.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log the library's info messages")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    add_run_flags(sub.add_parser("run", help="launch a training script (torchrun-compatible)", launches_script=True))
    demo = sub.add_parser("demo", help="a 4-rank training run that survives injected faults")
    demo.add_argument("--steps", type=_int, default=60)
    demo.add_argument("--nproc-per-node", type=_int, default=4)
    demo.add_argument("--run-dir", default=None)
    demo.add_argument("--plain", action="store_true", help="no live view (for logs and CI)")
    demo.add_argument("--script", choices=["gpt", "ddp"], default="gpt",
                      help="gpt: examples/train_gpt.py (kill, memory fault, NaN, hang); ddp: examples/train_ddp.py, "
                           "stock DistributedDataParallel (kill in the all-reduce, kill of rank 0, hang)")
    pool = sub.add_parser("pool", help="keep torch imported for this user's next launches (ranks fork from it)")
    pool.add_argument("--socket", default=None, metavar="PATH",
                      help="where to listen (default: $XDG_RUNTIME_DIR/unbroken/pool.sock, else /tmp/unbroken-<uid>/)")
    from unbroken.cli.ops import add_ops_commands

    add_ops_commands(sub)
    ckpt = sub.add_parser("ckpt", help="inspect, verify and export checkpoints")
    ckpt.add_argument("action", choices=["ls", "show", "verify", "export"])
    ckpt.add_argument("dir")
    ckpt.add_argument("--step", type=_int, default=None)
    ckpt.add_argument("--out", default=None, help="export: output file")
    ckpt.add_argument("--format", choices=["safetensors", "torch", "dcp"], default="safetensors")
    return parser


def launch_config(args: argparse.Namespace) -> LaunchConfig:
    """Resolve `unbroken run` flags into a LaunchConfig (environment < command line)."""
    master_addr, master_port = args.master_addr, args.master_port
    if args.rdzv_endpoint:
        host, _, port = args.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"--rdzv-endpoint {args.rdzv_endpoint!r} must be HOST:PORT")
        master_addr, master_port = host, int(port)
    job_id = args.rdzv_id or ""
    run_dir = Path(args.run_dir) if args.run_dir else None
    script_args = list(args.script_args)
    if script_args[:1] == ["--"]:  # `unbroken run ... script.py -- --flag` also works
        script_args = script_args[1:]
    cfg = LaunchConfig(
        script=args.script,
        script_args=tuple(script_args),
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=master_addr,
        master_port=master_port,
        run_dir=run_dir or Path("runs") / (job_id or "latest"),
        secret=secret_from_env(),
        job_id=job_id,
        inject=args.inject,
        standby=args.standby,
        prerun_spares=args.prerun_spares,
        fork_ranks=not args.no_fork_ranks,
        pool_socket=args.pool_socket,
        straggler_factor=args.straggler_factor,
        metrics_port=args.metrics_port,
        sigterm_dump_timeout_s=args.sigterm_dump_timeout_s,
        node_timeout_s=args.node_timeout_s,
        controller_store=args.controller_store,
        controller_lease_s=args.controller_lease_s,
        recovery=JobPolicy(max_restarts=args.max_restarts, allowed=parse_strategies(args.recover_strategy),
                           replicas_allowed=not args.no_replica_restore, sub_health_policy=args.sub_health_policy,
                           crash_loop_limit=args.crash_loop_limit, max_recurring=args.max_recurring_recoveries,
                           elastic_mode=args.elastic_mode, min_nodes=args.min_nodes,
                           elastic_lr_scaling=args.elastic_lr_scaling, scale_out=not args.no_scale_out),
        checkpoint=_checkpoint_config(args),
        hang=HangConfig(timeout_s=args.hang_timeout_s, first_step_timeout_s=args.first_step_timeout_s,
                        exit_timeout_s=args.exit_timeout_s),
        worker=WorkerSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(WorkerSettings)}),
    )
    from unbroken.faults.plan import parse_plan, validate_plan

    validate_plan(parse_plan(cfg.inject), cfg.world_size)
    return cfg


def _checkpoint_config(args: argparse.Namespace) -> CheckpointConfig:
    """Checkpoint intervals; with --save the defaults are: memory every step, storage every 10."""
    every, persist = args.ckpt_every_steps, args.persist_every_steps
    if args.save:
        every = 1 if every is None else every
        persist = max(10, every) if persist is None else persist
    if every and not Path(args.shm_dir).is_dir():
        raise ConfigError(f"--shm-dir {args.shm_dir!r} is not a directory; give an existing tmpfs directory "
                          "(default /dev/shm), or --ckpt-every-steps 0 to turn the shared-memory snapshots off")
    return CheckpointConfig(save_dir=args.save, load_dir=args.load, every_steps=every or 0,
                            persist_every_steps=persist or 0, keep=args.keep_checkpoints, shm_dir=args.shm_dir,
                            peer_memory=not args.no_peer_memory)


def _stop_on_sigterm(graceful) -> None:
    """SIGTERM (what Kubernetes and Slurm send): the first asks the running job to dump its newest
    committed step and stop (:class:`~unbroken.agent.launcher.GracefulStop`). Where it cannot,
    and on a second SIGTERM, the job stops at once like Ctrl-C: the main thread gets
    :class:`~unbroken.agent.launcher.Terminated`; a SIGTERM during that clean-up is ignored."""
    from unbroken.agent.launcher import Terminated

    def at_once(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated()

    def first(signum, frame):
        if graceful.request(signum):
            signal.signal(signal.SIGTERM, at_once)
            return
        at_once(signum, frame)

    signal.signal(signal.SIGTERM, first)


def cmd_run(args: argparse.Namespace) -> int:
    launch = launch_config(args)  # bad flags exit 2 here, before the launcher imports torch (seconds)
    from unbroken.agent.launcher import GracefulStop, resolve, run_job

    from unbroken.checkpoint.launch_dirs import check_launch_dirs

    cfg = resolve(launch)
    for note in check_launch_dirs(cfg.checkpoint.save_dir, cfg.checkpoint.load_dir):  # before any worker
        print(f"unbroken: {note}", file=sys.stderr)
    graceful = GracefulStop()
    _stop_on_sigterm(graceful)
    result = run_job(cfg, output=sys.stdout, graceful=graceful)
    gc.freeze()  # the job is over: the last collection at exit need not walk torch's heap (imported when a
    #              plain script used the attempt's TCPStore: ~1 s)
    if result.exit_code == 0:
        print(f"unbroken: job finished: {result.reason} (run dir {result.run_dir})")
    elif result.exit_code in (130, 143):
        print(f"unbroken: job stopped (exit {result.exit_code}): {result.reason}", file=sys.stderr)
    else:
        print(f"unbroken: job failed (exit {result.exit_code}): {result.reason}", file=sys.stderr)
        f = result.first_failure
        if f is not None and f.last_lines:
            print(f"unbroken: last output of rank {f.rank}:", file=sys.stderr)
            for line in f.last_lines[-10:]:
                print(f"    {line}", file=sys.stderr)
    return result.exit_code


def cmd_demo(args: argparse.Namespace) -> int:
    from unbroken.cli.demo import run_demo

    return run_demo(steps=args.steps, nproc=args.nproc_per_node, run_dir=args.run_dir, live=not args.plain,
                    script=args.script)


def cmd_pool(args: argparse.Namespace) -> int:
    from unbroken.agent import pool

    path = Path(args.socket) if args.socket else pool.default_socket()
    pool.serve(path, on_ready=lambda p: print(f"unbroken: pool ready at {p} (stop it with Ctrl-C or SIGTERM)",
                                              flush=True))
    print("unbroken: pool stopped", flush=True)
    return 0


def cmd_ckpt(args: argparse.Namespace) -> int:
    from unbroken.cli.ckpt import run_ckpt

    return run_ckpt(args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    else:
        logging.basicConfig(level=logging.WARNING, format="unbroken: %(message)s")
    from unbroken.cli.ops import cmd_report, cmd_status

    commands = {"run": cmd_run, "demo": cmd_demo, "ckpt": cmd_ckpt, "pool": cmd_pool, "status": cmd_status,
                "report": cmd_report}
    try:
        return commands[args.command](args)
    except ConfigError as exc:
        print(f"unbroken: error: {exc}", file=sys.stderr)
        return 2
    except UnbrokenError as exc:
        print(f"unbroken: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM outside a running job (its start, its end)
        signum = getattr(exc, "signum", signal.SIGINT)
        print(f"unbroken: stopped by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum


if __name__ == "__main__":
    sys.exit(main())
