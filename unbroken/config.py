"""The configuration tree: frozen dataclasses, validated when built.

Precedence is defaults < environment < command line. Only this module reads ``os.environ``:
the launcher resolves a :class:`LaunchConfig` from its flags, and passes each worker a :class:`WorkerConfig`
through environment variables that :func:`worker_config_from_env` reads back. Everything else takes config objects.

A worker setting is one field of :class:`WorkerSettings` (env variable, `unbroken run` flag, help, check derived).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from unbroken.errors import ConfigError
from unbroken.limits import (  # noqa: F401  (MAX_TIMEOUT_S: re-exported)
    IMPLEMENTED_RUNGS, MAX_TIMEOUT_S, check_host_port, require_strategy, require_timeout)
from unbroken.names import Rung

#: A user-given job secret (multi-node, standby) needs this many characters, this many distinct.
SECRET_MIN_CHARS = 32
SECRET_MIN_DISTINCT = 10

# Environment variables the launcher sets for its workers (beyond torchrun's own).
ENV_CONTROLLER = "UNBROKEN_CONTROLLER"  # host:port of the controller
ENV_RELAY = "UNBROKEN_RELAY"  # host:port of the node's agent relay (setting node_reports; agent/relay.py)
ENV_SECRET = "UNBROKEN_JOB_SECRET"
ENV_JOB_ID = "UNBROKEN_JOB_ID"
ENV_RUN_DIR = "UNBROKEN_RUN_DIR"
ENV_SAVE_DIR = "UNBROKEN_SAVE_DIR"
ENV_LOAD_DIR = "UNBROKEN_LOAD_DIR"
ENV_CKPT_EVERY = "UNBROKEN_CKPT_EVERY_STEPS"
ENV_KEEP = "UNBROKEN_KEEP_CHECKPOINTS"
ENV_PERSIST_EVERY = "UNBROKEN_PERSIST_EVERY_STEPS"
ENV_SHM_DIR = "UNBROKEN_SHM_DIR"
ENV_INJECT = "UNBROKEN_INJECT"
ENV_GEN = "UNBROKEN_GENERATION"  # set for a replacement: the generation it joins
ENV_STORE_PREFIX = "UNBROKEN_STORE_PREFIX"  # the attempt's secret rendezvous key prefix
ENV_PRERUN = "UNBROKEN_PRERUN"  # a pre-run spare (--prerun-spares): the fd it reports ready on

#: What a rank reported degraded (sub-health) leads to: nothing, or a dump and a clean restart.
SUB_HEALTH_POLICIES = ("ignore", "grace-exit")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def check_secret_strength(secret: str) -> None:
    """A user-given job secret must be hard to guess: SECRET_MIN_CHARS characters, SECRET_MIN_DISTINCT distinct, no padding."""
    stripped = secret.strip()
    _require(len(stripped) >= SECRET_MIN_CHARS and len(set(stripped)) >= SECRET_MIN_DISTINCT
             and stripped == secret,
             f"{ENV_SECRET} is too weak ({len(secret)} characters, {len(set(stripped))} distinct): a job secret "
             f"needs at least {SECRET_MIN_CHARS} characters, {SECRET_MIN_DISTINCT} of them distinct, and no "
             "leading or trailing whitespace; make one with "
             "`python -c 'import secrets; print(secrets.token_hex(32))'` and set it on every node")


def setting(default: bool | int | float, help: str, *, above: float | None = None, at_least: float | None = None,
            off: str = "", timeout: bool = False) -> Any:
    """A field of :class:`WorkerSettings`: its default, help text and range (``> above`` or ``>= at_least``;
    ``timeout``: a finite number of seconds in (0, MAX_TIMEOUT_S]; ``off`` names the value that turns it off)."""
    return field(default=default, metadata={"help": help, "above": above, "at_least": at_least, "off": off,
                                            "timeout": timeout})


def _check_setting(f: dataclasses.Field, value: Any, name: str) -> None:
    """``value`` of the :class:`WorkerSettings` field ``f`` is in its range; the message names
    ``name`` (the flag, the environment variable or the keyword the value came from)."""
    meta = f.metadata
    off = f" ({meta['off']})" if meta["off"] else ""
    if meta["timeout"]:
        require_timeout(value, name)
    if meta["above"] is not None:
        _require(value > meta["above"], f"{name} must be > {meta['above']}{off}, got {value}")
    if meta["at_least"] is not None:
        _require(value >= meta["at_least"], f"{name} must be >= {meta['at_least']}{off}, got {value}")


@dataclass(frozen=True)
class WorkerSettings:
    """What `unbroken run` tells every worker of its job, beyond ranks and addresses.

    One field per setting; :func:`setting_env` and :func:`setting_flag` derive its names.
    """

    pg_timeout_s: float = setting(60.0, "process-group timeout of the workers", timeout=True)
    recovery_timeout_s: float = setting(60.0, "deadline of one in-flight recovery attempt", timeout=True)
    sdc_check_every_steps: int = setting(
        0, "compare checksums of the state across replicas every K steps; an odd copy is repaired "
           "from the majority (silent data corruption; default 0: off)", at_least=0, off="0: off")
    finite_check: bool = setting(
        True, "do not treat a NaN/Inf loss or gradient as a fault (default: redo the step, rung retry)")
    spare_preimport: bool = setting(True, "warm spares do not import what the script imported (default: they do)")
    overlap_snapshots: bool = setting(True, "copy all state into the memory tier at the step boundary (default: "
                                            "parameters and optimizer state during the next forward/backward)")
    lazy_connect: bool = setting(False, "connect a pair of ranks of unbroken's gloo groups on its first message")
    node_reports: bool = setting(False, "step reports and commits through each node's agent (agent/relay.py)")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check_setting(f, getattr(self, f.name), f"--{setting_flag(f)}")

    def to_env(self) -> dict[str, str]:
        """The environment variables a worker reads these settings back from."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[setting_env(f)] = ("1" if value else "0") if isinstance(value, bool) else str(value)
        return out

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> WorkerSettings:
        """The settings in ``env`` (unset/empty: the default); out of range: a ConfigError naming its variable."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            key, default = setting_env(f), f.default
            if isinstance(default, bool):
                values[f.name] = env.get(key, "1" if default else "0") != "0"
            else:
                values[f.name] = _env_number(env, key, default, type(default))
                _check_setting(f, values[f.name], f"environment variable {key}")
        return cls(**values)


def setting_env(f: dataclasses.Field) -> str:
    """The environment variable of a :class:`WorkerSettings` field: ``UNBROKEN_<NAME>``."""
    return "UNBROKEN_" + f.name.upper()


def setting_flag(f: dataclasses.Field) -> str:
    """A :class:`WorkerSettings` field's `unbroken run` flag without dashes: its name, ``no-<name>`` if on by default."""
    name = f.name.replace("_", "-")
    return f"no-{name}" if f.default is True else name


@dataclass(frozen=True)
class HangConfig:
    """How the controller decides that a live worker is hung (no step progress).

    A rank that has not completed a step in the current attempt gets ``first_step_timeout_s`` (imports,
    process-group setup, restore). After that the timeout is ``max(floor_s, factor * median step time)``,
    calibrated from observed steps, unless ``timeout_s`` fixes it.
    """

    timeout_s: float | None = None
    floor_s: float = 5.0
    factor: float = 3.0
    first_step_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        require_timeout(self.timeout_s, "--hang-timeout-s", optional=True)
        require_timeout(self.floor_s, "hang floor")
        _require(math.isfinite(self.factor) and self.factor >= 1, f"hang factor must be >= 1, got {self.factor}")
        require_timeout(self.first_step_timeout_s, "--first-step-timeout-s")


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often tracked state is checkpointed."""

    save_dir: str | None = None
    load_dir: str | None = None
    every_steps: int = 0  # memory-tier snapshots under `unbroken run` (0: none)
    persist_every_steps: int = 0  # storage-tier checkpoints (0: none; without a memory tier: every_steps)
    keep: int = 3
    shm_dir: str = "/dev/shm"

    def __post_init__(self) -> None:
        _require(self.every_steps >= 0,
                 f"--ckpt-every-steps must be >= 0 (0 turns checkpoints off), got {self.every_steps}")
        _require(self.persist_every_steps >= 0,
                 f"--persist-every-steps must be >= 0 (0: never), got {self.persist_every_steps}")
        _require(self.keep >= 1, f"--keep-checkpoints must be >= 1, got {self.keep}")
        _require(not (self.every_steps and self.persist_every_steps % self.every_steps),
                 f"--persist-every-steps {self.persist_every_steps} must be a multiple of --ckpt-every-steps "
                 f"{self.every_steps} (storage checkpoints are made from shared-memory snapshots)")
        _require(not ((self.every_steps or self.persist_every_steps) and not self.save_dir),
                 "--ckpt-every-steps/--persist-every-steps need --save DIR (where checkpoints go)")

    @property
    def storage_every_steps(self) -> int:
        """How often a worker without a memory tier (plain torchrun, one process) writes storage."""
        return self.persist_every_steps or self.every_steps

    @property
    def resume_dir(self) -> str | None:
        """Where a (re)started job looks for checkpoints: what it saves, else what it was given."""
        return self.save_dir or self.load_dir


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
    max_restarts: int = 32767
    run_dir: Path = Path("runs/latest")
    secret: str = ""
    job_id: str = ""
    inject: str = ""
    recover_strategy: tuple[str, ...] = (Rung.RETRY, Rung.RECOVER_IN_PLACE, Rung.RECOVER, Rung.EXIT)
    standby: bool = False  # a spare agent: hosts ranks moved to it by the `recover` rung
    no_replica_restore: bool = False  # never restore from replicas: checkpoints only (seeds' no-replica)
    prerun_spares: bool = False  # spares run the script up to its first rank-dependent read (agent/prerun.py)
    stop_grace_s: float = 3.0
    # SIGTERM with --save: how long the job may take to dump its newest committed step before it
    # stops without it (0: never dump). With the stop grace and the agent's exit it must fit in the
    # cluster's kill deadline: Kubernetes' terminationGracePeriodSeconds (30 s unless set) >= this + 10 s.
    sigterm_dump_timeout_s: float = 20.0
    omp_num_threads: int = 1
    sub_health_policy: str = "ignore"
    crash_loop_limit: int = 3  # the same failure this many times in a row ends the job (0: never)
    straggler_factor: float = 0.0  # a rank computing this many times slower than the job's median is degraded
    metrics_port: int | None = None  # Prometheus /metrics, /status.json and the live page (None: off; 0: a free port)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    hang: HangConfig = field(default_factory=HangConfig)
    worker: WorkerSettings = field(default_factory=WorkerSettings)

    def __post_init__(self) -> None:
        _require(self.nproc_per_node >= 1, f"--nproc-per-node must be >= 1, got {self.nproc_per_node}")
        _require(self.nnodes >= 1, f"--nnodes must be >= 1, got {self.nnodes}")
        _require(0 <= self.node_rank < self.nnodes,
                 f"--node-rank must be in [0, {self.nnodes - 1}] for --nnodes {self.nnodes}, got {self.node_rank}")
        _require(0 <= self.master_port < 65536, f"--master-port must be in [0, 65535], got {self.master_port}")
        _require(not (self.nnodes > 1 and self.master_port == 0),
                 "--master-port is required with --nnodes > 1 (every node's agent must reach node 0)")
        _require(not (self.nnodes > 1 and not self.secret),
                 f"a job with --nnodes > 1 needs a shared secret: set {ENV_SECRET} on every node")
        _require(not (self.standby and (self.master_port == 0 or not self.secret)),
                 f"--standby joins a running job: give its --master-addr/--master-port and set {ENV_SECRET}")
        if self.nnodes > 1 or self.standby:  # the secret is the user's (single node: we make one)
            check_secret_strength(self.secret)
        _require(self.metrics_port is None or 0 <= self.metrics_port < 65536,
                 f"--metrics-port must be in [0, 65535] (0: a free port), got {self.metrics_port}")
        _require(self.max_restarts >= 0, f"--max-restarts must be >= 0, got {self.max_restarts}")
        _require(self.stop_grace_s >= 0, f"stop grace must be >= 0 s, got {self.stop_grace_s}")
        _require(isinstance(self.sigterm_dump_timeout_s, (int, float)) and math.isfinite(self.sigterm_dump_timeout_s)
                 and 0 <= self.sigterm_dump_timeout_s <= MAX_TIMEOUT_S, f"--sigterm-dump-timeout-s must be a number of seconds in [0, {MAX_TIMEOUT_S:.0f}] "
                 f"(0: no dump on SIGTERM), got {self.sigterm_dump_timeout_s}")
        _require(self.omp_num_threads >= 1, f"OMP threads must be >= 1, got {self.omp_num_threads}")
        for name in self.recover_strategy:
            require_strategy(name)
        _require(bool(self.recover_strategy), "--recover-strategy must name at least one strategy")
        _require(self.crash_loop_limit >= 0, f"--crash-loop-limit must be >= 0 (0: off), got {self.crash_loop_limit}")
        _require(self.straggler_factor == 0 or 1 < self.straggler_factor < math.inf,
                 f"--straggler-factor must be > 1 (or 0: off), got {self.straggler_factor}")
        _require(self.sub_health_policy in SUB_HEALTH_POLICIES, f"--sub-health-policy: unknown policy "
                 f"{self.sub_health_policy!r} (allowed: {', '.join(SUB_HEALTH_POLICIES)})")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["run_dir"] = str(self.run_dir)
        data["secret"] = "<redacted>" if self.secret else ""
        return json.dumps(data, indent=2, sort_keys=True)


def parse_strategies(text: str) -> tuple[str, ...]:
    """Parse ``--recover-strategy`` / the ``recover-strategy`` annotation: a comma list."""
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    for name in names:
        require_strategy(name)
    _require(bool(names), f"--recover-strategy: empty list (allowed: {', '.join(IMPLEMENTED_RUNGS)})")
    return names


def secret_from_env(env: Mapping[str, str] | None = None) -> str:
    """The job secret from the environment, or '' when none is set."""
    env = os.environ if env is None else env
    return env.get(ENV_SECRET, "")


def managed_from_env(env: Mapping[str, str] | None = None) -> bool:
    """True in a worker started by `unbroken run` (mode ``managed``), even if the rest of its environment is invalid."""
    env = os.environ if env is None else env
    return bool(env.get(ENV_CONTROLLER, ""))


def prerun_from_env(env: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """In a pre-run spare (agent/prerun.py): (the fd it reports ready on, the job's world size); else None."""
    env = os.environ if env is None else env
    return (_env_number(env, ENV_PRERUN, -1), _env_number(env, "WORLD_SIZE", 1)) if ENV_PRERUN in env else None


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker process knows about its job: resolved once, in :func:`worker_config_from_env`.

    ``mode`` is ``managed`` under `unbroken run`, ``torchrun`` under plain torchrun, ``single`` in plain ``python``.
    """

    mode: str = "single"
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    attempt: int = 0
    controller: str = ""
    secret: str = ""
    job_id: str = ""
    run_dir: str | None = None
    inject: str = ""
    gen: int = 0  # > 0: this process replaces a lost rank and joins generation `gen`
    store_prefix: str = ""  # managed: every rendezvous key lives under it (controller/rendezvous.py)
    relay: str = ""  # managed, setting node_reports: host:port of the node's agent relay (agent/relay.py)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    worker: WorkerSettings = field(default_factory=WorkerSettings)

    @property
    def replacement(self) -> bool:
        return self.gen > 0


def _env_number(env: Mapping[str, str], key: str, default: int | float, kind: type = int) -> Any:
    """``env[key]`` as ``kind`` (int or float); ``default`` when unset or empty."""
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    try:
        return kind(raw)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ConfigError(f"environment variable {key}={raw!r} must be {what}") from None


def worker_config_from_env(env: Mapping[str, str] | None = None, **overrides) -> WorkerConfig:
    """Build a worker's config from torchrun's and our environment; ``overrides`` win."""
    env = os.environ if env is None else env
    controller = env.get(ENV_CONTROLLER, "")
    mode = "managed" if controller else "torchrun" if "WORLD_SIZE" in env and "RANK" in env else "single"
    ckpt = CheckpointConfig(
        save_dir=env.get(ENV_SAVE_DIR) or None, load_dir=env.get(ENV_LOAD_DIR) or None,
        every_steps=_env_number(env, ENV_CKPT_EVERY, 0),
        persist_every_steps=_env_number(env, ENV_PERSIST_EVERY, 0),
        keep=_env_number(env, ENV_KEEP, 3),
        shm_dir=env.get(ENV_SHM_DIR) or "/dev/shm",
    )
    ckpt_fields = {k: overrides.pop(k) for k in ("save_dir", "load_dir", "every_steps", "persist_every_steps",
                                                 "keep") if k in overrides}
    if ckpt_fields:
        ckpt = dataclasses.replace(ckpt, **ckpt_fields)
    settings = WorkerSettings.from_env(env)
    setting_fields = {f.name: overrides.pop(f.name) for f in dataclasses.fields(WorkerSettings) if f.name in overrides}
    for f in dataclasses.fields(WorkerSettings):  # an init() keyword: named as such
        if f.name in setting_fields:
            _check_setting(f, setting_fields[f.name], f.name)
    if setting_fields:
        settings = dataclasses.replace(settings, **setting_fields)
    cfg = WorkerConfig(
        mode=mode,
        rank=_env_number(env, "RANK", 0),
        world_size=_env_number(env, "WORLD_SIZE", 1),
        local_rank=_env_number(env, "LOCAL_RANK", 0),
        local_world_size=_env_number(env, "LOCAL_WORLD_SIZE", 1),
        node_rank=_env_number(env, "GROUP_RANK", 0),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_env_number(env, "MASTER_PORT", 0),
        attempt=_env_number(env, "TORCHELASTIC_RESTART_COUNT", 0),
        controller=controller,
        secret=env.get(ENV_SECRET, ""),
        job_id=env.get(ENV_JOB_ID, ""),
        run_dir=env.get(ENV_RUN_DIR) or None,
        inject=env.get(ENV_INJECT, ""),
        gen=_env_number(env, ENV_GEN, 0),
        store_prefix=env.get(ENV_STORE_PREFIX, ""),
        relay=env.get(ENV_RELAY, ""),
        checkpoint=ckpt,
        worker=settings,
    )
    cfg = dataclasses.replace(cfg, **overrides) if overrides else cfg
    _require(cfg.world_size >= 1, f"WORLD_SIZE must be >= 1, got {cfg.world_size}")
    _require(0 <= cfg.rank < cfg.world_size, f"RANK={cfg.rank} must be in [0, WORLD_SIZE={cfg.world_size})")
    if cfg.mode == "managed":
        _require(bool(cfg.secret), f"{ENV_CONTROLLER} is set but {ENV_SECRET} is not")
        check_host_port(cfg.controller, f"environment variable {ENV_CONTROLLER}")
        _require(bool(cfg.store_prefix), f"{ENV_CONTROLLER} is set but {ENV_STORE_PREFIX} is not "
                                         "(both come from `unbroken run`)")
        if cfg.relay:  # the agent relay (setting node_reports)
            check_host_port(cfg.relay, f"environment variable {ENV_RELAY}")
    return cfg


def worker_env(cfg: LaunchConfig, *, rank: int, local_rank: int, attempt: int,
               controller: str, store_host: str, store_port: int, gen: int = 0,
               world_size: int = 0, store_prefix: str = "", relay: str = "") -> dict[str, str]:
    """The environment a worker gets from the agent: torchrun's variables plus ours.

    ``world_size`` is the job's, as the controller says (0: this launcher's own flags);
    ``relay``: the agent relay's host:port ("": the worker reports to the controller directly)."""
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
        "TORCHELASTIC_MAX_RESTARTS": str(cfg.max_restarts),
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
    }
    if ckpt.save_dir:
        env[ENV_SAVE_DIR] = ckpt.save_dir
    if ckpt.load_dir:
        env[ENV_LOAD_DIR] = ckpt.load_dir
    return env
