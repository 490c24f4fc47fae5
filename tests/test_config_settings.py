"""A worker setting is one field of WorkerSettings: its flag, env variable and check derived."""

from __future__ import annotations

import dataclasses

import pytest

from unbroken.cli.main import build_parser, launch_config
from unbroken.config import LaunchConfig, worker_env
from unbroken.errors import ConfigError
from unbroken.recovery.policy import JobPolicy
from unbroken.worker_config import WorkerSettings, setting_env, setting_flag, worker_config_from_env

FIELDS = dataclasses.fields(WorkerSettings)


def _changed(f: dataclasses.Field):
    """A valid value of ``f`` other than its default."""
    return (not f.default) if isinstance(f.default, bool) else f.default + 3


def _argv(f: dataclasses.Field, value) -> list[str]:
    return [f"--{setting_flag(f)}"] if isinstance(value, bool) else [f"--{setting_flag(f)}", str(value)]


@pytest.mark.parametrize("f", FIELDS, ids=lambda f: f.name)
def test_a_setting_goes_from_its_flag_through_the_environment_to_the_worker(f):
    value = _changed(f)
    args = build_parser().parse_args(["run", *_argv(f, value), "train.py"])
    cfg = launch_config(args)
    assert getattr(cfg.worker, f.name) == value
    env = worker_env(cfg, rank=0, local_rank=0, attempt=0, controller="", store_host="h", store_port=1)
    assert setting_env(f) in env
    assert getattr(worker_config_from_env(env).worker, f.name) == value


@pytest.mark.parametrize("f", FIELDS, ids=lambda f: f.name)
def test_unset_means_the_default_and_init_overrides_win(f):
    assert getattr(worker_config_from_env({}).worker, f.name) == f.default
    assert getattr(worker_config_from_env({}, **{f.name: _changed(f)}).worker, f.name) == _changed(f)


@pytest.mark.parametrize("f", [f for f in FIELDS if f.metadata["above"] is not None
                               or f.metadata["at_least"] is not None or f.metadata["timeout"]], ids=lambda f: f.name)
def test_a_value_out_of_range_names_the_flag(f):
    meta = f.metadata
    bound = 0 if meta["timeout"] else meta["above"] if meta["above"] is not None else meta["at_least"] - 1
    with pytest.raises(ConfigError, match=f"--{setting_flag(f)} must be"):
        WorkerSettings(**{f.name: type(f.default)(bound)})


@pytest.mark.parametrize("f", [f for f in FIELDS if f.metadata["timeout"]], ids=lambda f: f.name)
@pytest.mark.parametrize("value", [float("inf"), float("nan"), 86400.5])
def test_a_timeout_setting_is_finite_and_at_most_a_day_from_flag_env_and_init(f, value):
    with pytest.raises(ConfigError, match=rf"--{setting_flag(f)} must be a number of seconds in \(0, 86400\]"):
        WorkerSettings(**{f.name: value})
    with pytest.raises(ConfigError, match=f"environment variable {setting_env(f)} must be"):
        worker_config_from_env({setting_env(f): str(value)})
    with pytest.raises(ConfigError, match=f"^{f.name} must be"):
        worker_config_from_env({}, **{f.name: value})


def test_the_derived_names_are_the_documented_ones():
    names = {f.name: (setting_flag(f), setting_env(f)) for f in FIELDS}
    assert names["finite_check"] == ("no-finite-check", "UNBROKEN_FINITE_CHECK")
    assert names["pg_timeout_s"] == ("pg-timeout-s", "UNBROKEN_PG_TIMEOUT_S")
    assert names["spare_preimport"] == ("no-spare-preimport", "UNBROKEN_SPARE_PREIMPORT")
    assert names["overlap_snapshots"] == ("no-overlap-snapshots", "UNBROKEN_OVERLAP_SNAPSHOTS")
    assert names["lazy_connect"] == ("lazy-connect", "UNBROKEN_LAZY_CONNECT")
    assert names["node_reports"] == ("node-reports", "UNBROKEN_NODE_REPORTS")
    assert LaunchConfig(script="x").worker == WorkerSettings()


def test_the_recovery_flags_are_one_section_that_is_the_ladders_policy():
    """`unbroken run`'s recovery flags land in LaunchConfig.recovery, the JobPolicy the controller's state
    machine and the ladder read: no second set of names on the way (issue 31, item 4)."""
    args = build_parser().parse_args(["run", "--max-restarts", "7", "--recover-strategy", "recover-in-place,exit",
                                      "--no-replica-restore", "--sub-health-policy", "grace-exit",
                                      "--crash-loop-limit", "0", "--max-recurring-recoveries", "4", "--no-scale-out",
                                      "train.py"])
    cfg = launch_config(args)
    assert cfg.recovery == JobPolicy(max_restarts=7, allowed=("recover-in-place", "exit"), replicas_allowed=False,
                                     sub_health_policy="grace-exit", crash_loop_limit=0, max_recurring=4,
                                     scale_out=False)
    assert launch_config(build_parser().parse_args(["run", "train.py"])).recovery == JobPolicy()  # one set of defaults
    assert worker_env(cfg, rank=0, local_rank=0, attempt=0, controller="h:1", store_host="h",
                      store_port=2)["TORCHELASTIC_MAX_RESTARTS"] == "7"


@pytest.mark.parametrize("change, flag", [
    ({"max_restarts": -1}, "--max-restarts must be >= 0"),
    ({"allowed": ()}, "--recover-strategy must name at least one strategy"),
    ({"elastic_mode": "slow"}, "--elastic-mode: unknown mode 'slow'"),
    ({"min_nodes": 0}, "--min-nodes must be >= 1"),
    ({"allowed": ("bogus",)}, "--recover-strategy: unknown strategy 'bogus'"),
    ({"crash_loop_limit": -1}, "--crash-loop-limit must be >= 0"),
    ({"max_recurring": 0}, "--max-recurring-recoveries must be >= 1"),
    ({"sub_health_policy": "reboot"}, "--sub-health-policy: unknown policy 'reboot'"),
])
def test_a_bad_recovery_policy_is_refused_naming_its_flag(change, flag):
    with pytest.raises(ConfigError, match=flag):
        JobPolicy(**change)
