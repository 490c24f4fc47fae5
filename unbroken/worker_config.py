"""A worker's config: what `unbroken run` tells each worker, and how the worker reads it back.

The launcher (:mod:`unbroken.config`) writes a worker's environment (``worker_env``); a worker
process reads it back once, in :func:`worker_config_from_env`, into a :class:`WorkerConfig`.
This module holds that contract: the environment variables' names, the worker settings
(:class:`WorkerSettings`: one field per setting, its variable, `unbroken run` flag, help and
range derived), the checkpoint settings (:class:`CheckpointConfig`) and the reader. Under
`unbroken run` every variable of it is written by the agent from the launcher's flags.
Only this module and :mod:`unbroken.config` read ``os.environ``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from unbroken.errors import ConfigError
from unbroken.limits import check_host_port, require, require_timeout

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
# Set once rung elastic shrank the job (controller/elastic.py); absent before.
ENV_DATA_RANKS = "UNBROKEN_DATA_RANKS"  # the data-parallel ranks this rank runs, e.g. "0,2"
ENV_DATA_WORLD_SIZE = "UNBROKEN_DATA_WORLD_SIZE"  # the data-parallel world the global batch is split into
ENV_RESTORE_RANK = "UNBROKEN_RESTORE_RANK"  # whose memory-tier snapshot on this node this rank restores
ENV_LR_SCALE = "UNBROKEN_LR_SCALE"  # --elastic-lr-scaling's factor (fast mode)


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


def setting(default: bool | int | float, help: str, *, above: float | None = None, at_least: float | None = None,
            off: str = "", timeout: bool = False) -> Any:
    """A field of :class:`WorkerSettings`: its default, help text and range (``> above`` or ``>= at_least``;
    ``timeout``: a finite number of seconds in (0, MAX_TIMEOUT_S]; ``off`` names the value that turns it off)."""
    return field(default=default, metadata={"help": help, "above": above, "at_least": at_least, "off": off,
                                            "timeout": timeout})


def check_setting(f: dataclasses.Field, value: Any, name: str) -> None:
    """``value`` of the :class:`WorkerSettings` field ``f`` is in its range; the message names
    ``name`` (the flag, the environment variable or the keyword the value came from)."""
    meta = f.metadata
    off = f" ({meta['off']})" if meta["off"] else ""
    if meta["timeout"]:
        require_timeout(value, name)
    if meta["above"] is not None:
        require(value > meta["above"], f"{name} must be > {meta['above']}{off}, got {value}")
    if meta["at_least"] is not None:
        require(value >= meta["at_least"], f"{name} must be >= {meta['at_least']}{off}, got {value}")


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
    node_summaries: bool = setting(
        False, "each node's agent keeps its ranks' steady step reports and sends the controller one summary a "
               "second (agent/held_reports.py; implies --node-reports; a lost node's ranks then restart from "
               "the newest snapshot, not in flight)")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check_setting(f, getattr(self, f.name), f"--{setting_flag(f)}")

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
                check_setting(f, values[f.name], f"environment variable {key}")
        return cls(**values)


def setting_env(f: dataclasses.Field) -> str:
    """The environment variable of a :class:`WorkerSettings` field: ``UNBROKEN_<NAME>``."""
    return "UNBROKEN_" + f.name.upper()


def setting_flag(f: dataclasses.Field) -> str:
    """A :class:`WorkerSettings` field's `unbroken run` flag without dashes: its name, ``no-<name>`` if on by default."""
    name = f.name.replace("_", "-")
    return f"no-{name}" if f.default is True else name


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often tracked state is checkpointed."""

    save_dir: str | None = None
    load_dir: str | None = None
    every_steps: int = 0  # memory-tier snapshots under `unbroken run` (0: none)
    persist_every_steps: int = 0  # storage-tier checkpoints (0: none; without a memory tier: every_steps)
    keep: int = 3
    shm_dir: str = "/dev/shm"
    peer_memory: bool = True  # the agent keeps a copy of each snapshot in the next node's memory (agent/peer_memory.py)

    def __post_init__(self) -> None:
        require(self.every_steps >= 0,
                f"--ckpt-every-steps must be >= 0 (0 turns checkpoints off), got {self.every_steps}")
        require(self.persist_every_steps >= 0,
                f"--persist-every-steps must be >= 0 (0: never), got {self.persist_every_steps}")
        require(self.keep >= 1, f"--keep-checkpoints must be >= 1, got {self.keep}")
        require(not (self.every_steps and self.persist_every_steps % self.every_steps),
                f"--persist-every-steps {self.persist_every_steps} must be a multiple of --ckpt-every-steps "
                f"{self.every_steps} (storage checkpoints are made from shared-memory snapshots)")
        require(not ((self.every_steps or self.persist_every_steps) and not self.save_dir),
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
    data_ranks: tuple[int, ...] = ()  # the data-parallel ranks this rank runs (rung elastic); (): (rank,)
    data_world_size: int = 0  # the data-parallel world the global batch is split into; 0: world_size
    restore_rank: int = -1  # whose memory-tier snapshot this rank restores at a (re)start; -1: its own
    lr_scale: float = 1.0  # the factor --elastic-lr-scaling hands the script

    @property
    def replacement(self) -> bool:
        return self.gen > 0

    @property
    def my_data_ranks(self) -> tuple[int, ...]:
        return self.data_ranks or (self.rank,)

    @property
    def my_data_world_size(self) -> int:
        return self.data_world_size or self.world_size


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
            check_setting(f, setting_fields[f.name], f.name)
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
        data_ranks=_env_ranks(env, ENV_DATA_RANKS),
        data_world_size=_env_number(env, ENV_DATA_WORLD_SIZE, 0),
        restore_rank=_env_number(env, ENV_RESTORE_RANK, -1),
        lr_scale=_env_number(env, ENV_LR_SCALE, 1.0, float),
    )
    cfg = dataclasses.replace(cfg, **overrides) if overrides else cfg
    require(cfg.world_size >= 1, f"WORLD_SIZE must be >= 1, got {cfg.world_size}")
    require(0 <= cfg.rank < cfg.world_size, f"RANK={cfg.rank} must be in [0, WORLD_SIZE={cfg.world_size})")
    _check_data_ranks(cfg)
    if cfg.mode == "managed":
        require(bool(cfg.secret), f"{ENV_CONTROLLER} is set but {ENV_SECRET} is not")
        check_host_port(cfg.controller, f"environment variable {ENV_CONTROLLER}")
        require(bool(cfg.store_prefix), f"{ENV_CONTROLLER} is set but {ENV_STORE_PREFIX} is not "
                                        "(both come from `unbroken run`)")
        if cfg.relay:  # the agent relay (setting node_reports)
            check_host_port(cfg.relay, f"environment variable {ENV_RELAY}")
    return cfg


def _check_data_ranks(cfg: WorkerConfig) -> None:
    """The elastic shape from the agent (controller/elastic.py) is consistent, or a ConfigError naming it."""
    world = cfg.my_data_world_size
    ranks = cfg.my_data_ranks
    require(world >= 1, f"environment variable {ENV_DATA_WORLD_SIZE}={cfg.data_world_size} must be >= 1")
    require(len(set(ranks)) == len(ranks) and all(0 <= d < world for d in ranks),
            f"environment variable {ENV_DATA_RANKS}={','.join(map(str, ranks))} must be distinct ranks in "
            f"[0, {world}) ({ENV_DATA_WORLD_SIZE}={world}); `unbroken run` sets it after the job shrank")
    require(math.isfinite(cfg.lr_scale) and cfg.lr_scale > 0,
            f"environment variable {ENV_LR_SCALE}={cfg.lr_scale} must be a number > 0")


def _env_ranks(env: Mapping[str, str], name: str) -> tuple[int, ...]:
    text = env.get(name, "").strip()
    if not text:
        return ()
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"environment variable {name}={text!r} must be a comma list of ranks, e.g. 0,2") from None


def managed_from_env(env: Mapping[str, str] | None = None) -> bool:
    """True in a worker started by `unbroken run` (mode ``managed``), even if the rest of its environment is invalid."""
    env = os.environ if env is None else env
    return bool(env.get(ENV_CONTROLLER, ""))


def prerun_from_env(env: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """In a pre-run spare (agent/prerun.py): (the fd it reports ready on, the job's world size); else None."""
    env = os.environ if env is None else env
    return (_env_number(env, ENV_PRERUN, -1), _env_number(env, "WORLD_SIZE", 1)) if ENV_PRERUN in env else None
