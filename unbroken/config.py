"""The launcher's configuration tree: frozen dataclasses, validated when built.

Precedence is defaults < environment < command line. `unbroken run` resolves a :class:`LaunchConfig`
from its flags (cli/main.py) and writes each worker's environment from it (:func:`worker_env`); what a
worker reads back, and the names of those variables, live in :mod:`unbroken.worker_config`. Only these
two modules read ``os.environ``. Everything else takes config objects.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from unbroken.limits import (  # noqa: F401  (MAX_TIMEOUT_S: re-exported)
    IMPLEMENTED_RUNGS, MAX_TIMEOUT_S, require, require_strategy, require_timeout)
from unbroken.controller.liveness import DEFAULT_NODE_TIMEOUT_S
from unbroken.recovery.policy import JobPolicy
from unbroken.worker_config import (  # CheckpointConfig, WorkerSettings: LaunchConfig's parts (benchmarks/ too)
    ENV_CKPT_EVERY, ENV_CONTROLLER, ENV_GEN, ENV_INJECT, ENV_JOB_ID, ENV_KEEP, ENV_LOAD_DIR, ENV_PERSIST_EVERY,
    ENV_RELAY, ENV_RUN_DIR, ENV_SAVE_DIR, ENV_SECRET, ENV_SHM_DIR, ENV_STORE_PREFIX, CheckpointConfig,
    WorkerSettings)

#: A user-given job secret (multi-node, standby) needs this many characters, this many distinct.
SECRET_MIN_CHARS = 32
SECRET_MIN_DISTINCT = 10


def check_secret_strength(secret: str) -> None:
    """A user-given job secret must be hard to guess: SECRET_MIN_CHARS characters, SECRET_MIN_DISTINCT distinct, no padding."""
    stripped = secret.strip()
    require(len(stripped) >= SECRET_MIN_CHARS and len(set(stripped)) >= SECRET_MIN_DISTINCT
            and stripped == secret,
            f"{ENV_SECRET} is too weak ({len(secret)} characters, {len(set(stripped))} distinct): a job secret "
            f"needs at least {SECRET_MIN_CHARS} characters, {SECRET_MIN_DISTINCT} of them distinct, and no "
            "leading or trailing whitespace; make one with "
            "`python -c 'import secrets; print(secrets.token_hex(32))'` and set it on every node")


@dataclass(frozen=True)
class HangConfig:
    """How the controller decides that a live worker is hung (no step progress).

    A rank that has not completed a step in the current attempt, or since the last in-flight recovery, gets
    ``first_step_timeout_s`` (imports, process-group setup, restore, a replacement's first step). After that the
    timeout is calibrated from observed steps, unless ``timeout_s`` fixes it:

    * ``max(evidence_floor_s, factor * p99 step time)`` for a rank with evidence against it: its agent sees
      its process stopped or a zombie, or it has not reached the step's collective while every other rank
      waits in it (controller/hangs.py);
    * ``max(floor_s, factor * p99 step time)`` without evidence (every rank silent alike: a hang inside the
      collective itself, or a job whose ranks all stall), where nothing tells the culprit from its victims.

    The strongest evidence needs no calibration: a rank whose process its agent has seen stopped (SIGSTOP, a
    debugger's stop) or a zombie for ``stopped_s``, with no other rank behind it (each waits in a collective or
    is at or past its step and phase, so will wait there), is hung however long steps take: it cannot progress,
    and the others cannot without it. ``stopped_s`` spans two of the agent's
    looks at the process (a brief stop, e.g. a profiler's sample, is seen running again first). A fixed
    ``timeout_s`` applies here too.
    """

    timeout_s: float | None = None
    floor_s: float = 5.0
    evidence_floor_s: float = 1.0
    stopped_s: float = 0.25
    factor: float = 3.0
    first_step_timeout_s: float = 60.0
    #: How long a rank past its step loop may keep running once every other rank has exited
    #: (--exit-timeout-s): then it is hung there (a final save stuck, destroy_process_group waiting on
    #: peers that are gone), killed, and counts as finished (controller/loop_end.py).
    exit_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        require_timeout(self.timeout_s, "--hang-timeout-s", optional=True)
        require_timeout(self.floor_s, "hang floor")
        require_timeout(self.evidence_floor_s, "hang floor with evidence")
        require_timeout(self.stopped_s, "hang timeout of a stopped process")
        require(math.isfinite(self.factor) and self.factor >= 1, f"hang factor must be >= 1, got {self.factor}")
        require_timeout(self.first_step_timeout_s, "--first-step-timeout-s")
        require_timeout(self.exit_timeout_s, "--exit-timeout-s")


@dataclass(frozen=True)
class LaunchConfig:
    """Everything `unbroken run` needs; written to ``run_dir/config.json`` at start."""

    script: str
    script_args: tuple[str, ...] = ()
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port (single node only)
    run_dir: Path = Path("runs/latest")
    secret: str = ""
    job_id: str = ""
    inject: str = ""
    standby: bool = False  # a spare agent: hosts ranks moved to it by the `recover` rung
    prerun_spares: bool = False  # spares run the script up to its first rank-dependent read (agent/prerun.py)
    fork_ranks: bool = True  # ranks are forked from the node's zygote, which imported torch once (agent/forks.py)
    pool_socket: str = ""  # a pool's socket (agent/pool.py; "": the default one, used when a pool listens there)
    stop_grace_s: float = 3.0
    # SIGTERM with --save: how long the job may take to dump its newest committed step before it
    # stops without it (0: never dump). With the stop grace and the agent's exit it must fit in the
    # cluster's kill deadline: Kubernetes' terminationGracePeriodSeconds (30 s unless set) >= this + 10 s.
    sigterm_dump_timeout_s: float = 20.0
    omp_num_threads: int = 1
    straggler_factor: float = 0.0  # a rank computing this many times slower than the job's median is degraded
    # Heartbeats both ways: the controller declares a silent node lost after this; a node that hears
    # nothing from the controller for half of it stops its own workers (controller/liveness.py).
    node_timeout_s: float = DEFAULT_NODE_TIMEOUT_S
    metrics_port: int | None = None  # Prometheus /metrics, /status.json and the live page (None: off; 0: a free port)
    # Controller failover (agent/failover.py): etcd endpoints, "etcd://HOST:PORT[,HOST:PORT...]" ("": off,
    # the controller lives in node 0's agent), and the leader's lease in whole seconds.
    controller_store: str = ""
    controller_lease_s: int = 2
    recovery: JobPolicy = field(default_factory=JobPolicy)  # the recovery flags, as the ladder reads them
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    hang: HangConfig = field(default_factory=HangConfig)
    worker: WorkerSettings = field(default_factory=WorkerSettings)

    def __post_init__(self) -> None:
        require(self.nproc_per_node >= 1, f"--nproc-per-node must be >= 1, got {self.nproc_per_node}")
        require(self.nnodes >= 1, f"--nnodes must be >= 1, got {self.nnodes}")
        require(0 <= self.node_rank < self.nnodes,
                f"--node-rank must be in [0, {self.nnodes - 1}] for --nnodes {self.nnodes}, got {self.node_rank}")
        require(0 <= self.master_port < 65536, f"--master-port must be in [0, 65535], got {self.master_port}")
        require(not (self.nnodes > 1 and self.master_port == 0),
                "--master-port is required with --nnodes > 1 (every node's agent must reach node 0)")
        require(not (self.nnodes > 1 and not self.secret),
                f"a job with --nnodes > 1 needs a shared secret: set {ENV_SECRET} on every node")
        require(not (self.standby and (self.master_port == 0 or not self.secret)),
                f"--standby joins a running job: give its --master-addr/--master-port and set {ENV_SECRET}")
        if self.nnodes > 1 or self.standby:  # the secret is the user's (single node: we make one)
            check_secret_strength(self.secret)
        require(self.metrics_port is None or 0 <= self.metrics_port < 65536,
                f"--metrics-port must be in [0, 65535] (0: a free port), got {self.metrics_port}")
        require(self.stop_grace_s >= 0, f"stop grace must be >= 0 s, got {self.stop_grace_s}")
        require(isinstance(self.sigterm_dump_timeout_s, (int, float)) and math.isfinite(self.sigterm_dump_timeout_s)
                and 0 <= self.sigterm_dump_timeout_s <= MAX_TIMEOUT_S, f"--sigterm-dump-timeout-s must be a number of seconds in [0, {MAX_TIMEOUT_S:.0f}] "
                f"(0: no dump on SIGTERM), got {self.sigterm_dump_timeout_s}")
        require_timeout(self.node_timeout_s, "--node-timeout-s")
        require(self.standby or self.recovery.min_nodes <= self.nnodes,
                f"--min-nodes {self.recovery.min_nodes} is more than the job's --nnodes {self.nnodes}")
        if self.controller_store:
            self._check_controller_store()
        require(self.omp_num_threads >= 1, f"OMP threads must be >= 1, got {self.omp_num_threads}")
        require(self.straggler_factor == 0 or 1 < self.straggler_factor < math.inf,
                f"--straggler-factor must be > 1 (or 0: off), got {self.straggler_factor}")

    def _check_controller_store(self) -> None:
        from unbroken.consensus.etcd import parse_endpoints

        parse_endpoints(self.controller_store)  # a ConfigError naming the flag and the form
        require(self.nnodes > 1 or self.standby,
                f"--controller-store {self.controller_store!r} is for a job of several nodes (--nnodes > 1, or "
                "--standby): a single-node job keeps its controller in its own agent and needs no etcd")
        require(bool(self.job_id), "--controller-store needs the job's id, the same on every node (--rdzv-id ID): "
                                   "the job's keys in etcd are named by it")
        require(isinstance(self.controller_lease_s, int) and 1 <= self.controller_lease_s <= 60,
                f"--controller-lease-s must be whole seconds in [1, 60], got {self.controller_lease_s}")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["run_dir"] = str(self.run_dir)
        data["secret"] = "<redacted>" if self.secret else ""
        return json.dumps(data, indent=2, sort_keys=True)


#: MindCluster's names for our rungs, accepted at the edge (DESIGN.md section 1).
STRATEGY_ALIASES = {"elastic-training": "elastic"}


def parse_strategies(text: str) -> tuple[str, ...]:
    """Parse ``--recover-strategy`` / the ``recover-strategy`` annotation: a comma list."""
    names = tuple(STRATEGY_ALIASES.get(part.strip(), part.strip()) for part in text.split(",") if part.strip())
    for name in names:
        require_strategy(name)
    require(bool(names), f"--recover-strategy: empty list (allowed: {', '.join(IMPLEMENTED_RUNGS)})")
    return names


def secret_from_env(env: Mapping[str, str] | None = None) -> str:
    """The job secret from the environment, or '' when none is set."""
    env = os.environ if env is None else env
    return env.get(ENV_SECRET, "")


def worker_env(cfg: LaunchConfig, *, rank: int, local_rank: int, attempt: int,
               controller: str, store_host: str, store_port: int, gen: int = 0,
               world_size: int = 0, store_prefix: str = "", relay: str = "",
               extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a worker gets from the agent: torchrun's variables plus ours.

    ``world_size`` is the job's, as the controller says (0: this launcher's own flags);
    ``relay``: the agent relay's host:port ("": the worker reports to the controller directly);
    ``extra``: more variables (a shrunk job's data ranks: agent/placement.py)."""
    ckpt = cfg.checkpoint
    world_size = world_size or cfg.world_size
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(cfg.nproc_per_node),
        "GROUP_RANK": str(cfg.node_rank),
        "GROUP_WORLD_SIZE": str(cfg.nnodes),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world_size),
        "ROLE_NAME": "default",
        "MASTER_ADDR": store_host,
        "MASTER_PORT": str(store_port),
        "TORCHELASTIC_RESTART_COUNT": str(attempt),
        "TORCHELASTIC_MAX_RESTARTS": str(cfg.recovery.max_restarts),
        "TORCHELASTIC_RUN_ID": cfg.job_id,
        # The store lives in the controller (a fresh one per attempt): every rank is a client.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        # Results depend on the intra-op thread count (FACTS.md): pin it for every process.
        "OMP_NUM_THREADS": str(cfg.omp_num_threads),
        "PYTHONUNBUFFERED": "1",
        ENV_CONTROLLER: controller,
        ENV_SECRET: cfg.secret,
        ENV_JOB_ID: cfg.job_id,
        ENV_RUN_DIR: str(cfg.run_dir),
        ENV_INJECT: cfg.inject,
        ENV_CKPT_EVERY: str(ckpt.every_steps),
        ENV_PERSIST_EVERY: str(ckpt.persist_every_steps),
        ENV_KEEP: str(ckpt.keep),
        ENV_SHM_DIR: ckpt.shm_dir,
        ENV_GEN: str(gen),
        ENV_STORE_PREFIX: store_prefix,
        ENV_RELAY: relay,
        **cfg.worker.to_env(),
        **(extra or {}),
    }
    if ckpt.save_dir:
        env[ENV_SAVE_DIR] = ckpt.save_dir
    if ckpt.load_dir:
        env[ENV_LOAD_DIR] = ckpt.load_dir
    return env
