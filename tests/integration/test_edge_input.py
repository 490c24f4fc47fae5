"""Every number and secret is checked at the edge (issue 11, items 10, 14, 15).

A bad value is a usage error: `unbroken run` exits 2 before any worker starts, with a
message naming the flag or environment variable and what is allowed; a worker given a bad
environment ends with EXIT_FATAL and one clear line, never a raw traceback or a restart loop.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from tests.conftest import EXAMPLE, REPO, run_cli
from unbroken.config import LaunchConfig, check_secret_strength
from unbroken.errors import EXIT_FATAL, ConfigError
from unbroken.worker_config import WorkerSettings, worker_config_from_env

STRONG = "0123456789abcdef" * 2  # 32 characters, 16 distinct
WORKER_SETTINGS = {f.name for f in dataclasses.fields(WorkerSettings)}


@pytest.mark.parametrize("field, value, flag", [
    ("recovery_timeout_s", -1.0, "--recovery-timeout-s"),
    ("recovery_timeout_s", float("nan"), "--recovery-timeout-s"),
    ("recovery_timeout_s", 0.0, "--recovery-timeout-s"),
    ("pg_timeout_s", float("inf"), "--pg-timeout-s"),
    ("pg_timeout_s", 1e300, "--pg-timeout-s"),
    ("straggler_factor", float("inf"), "--straggler-factor"),
])
def test_launch_numbers_must_be_finite_and_in_range(field, value, flag):
    with pytest.raises(ConfigError, match=flag) as err:
        if field in WORKER_SETTINGS:  # a worker setting: a field of LaunchConfig.worker
            LaunchConfig(script="x.py", worker=WorkerSettings(**{field: value}))
        else:
            LaunchConfig(script="x.py", **{field: value})
    if field != "straggler_factor":
        assert "(0, 86400]" in str(err.value)


@pytest.mark.parametrize("key, value", [
    ("UNBROKEN_PG_TIMEOUT_S", "inf"), ("UNBROKEN_PG_TIMEOUT_S", "-1"), ("UNBROKEN_PG_TIMEOUT_S", "nan"),
    ("UNBROKEN_RECOVERY_TIMEOUT_S", "1e300"),
    ("UNBROKEN_CONTROLLER", "garbage"), ("UNBROKEN_CONTROLLER", "host:99999"),
])
def test_worker_environment_is_checked_naming_the_variable(key, value):
    env = {"UNBROKEN_CONTROLLER": "127.0.0.1:29400", "UNBROKEN_JOB_SECRET": STRONG, "RANK": "0",
           "WORLD_SIZE": "1", key: value}
    with pytest.raises(ConfigError, match=f"environment variable {key}"):
        worker_config_from_env(env)


@pytest.mark.parametrize("secret", ["a", " " * 40, "ab" * 20, "\t" + STRONG, STRONG[:31]])
def test_weak_job_secret_refused_saying_the_rule(secret):
    with pytest.raises(ConfigError, match="at least 32 characters, 10 of them distinct"):
        check_secret_strength(secret)
    with pytest.raises(ConfigError, match="UNBROKEN_JOB_SECRET is too weak"):
        LaunchConfig(script="x.py", nnodes=2, master_port=29400, secret=secret)
    LaunchConfig(script="x.py", nnodes=2, master_port=29400, secret=STRONG)  # a strong one is taken


@pytest.mark.timeout(90)
@pytest.mark.parametrize("flags, env, expected", [
    (["--recovery-timeout-s", "-1"], {}, "--recovery-timeout-s must be a number of seconds in (0, 86400]"),
    (["--recovery-timeout-s", "nan"], {}, "--recovery-timeout-s must be"),
    (["--pg-timeout-s", "1e300"], {}, "--pg-timeout-s must be"),
    (["--elastic-mode", "slow"], {}, "--elastic-mode: unknown mode 'slow' (allowed: exact, fast)"),
    (["--min-nodes", "2"], {}, "--min-nodes 2 is more than the job's --nnodes 1"),
    (["--nnodes", "2", "--master-port", "29999"], {"UNBROKEN_JOB_SECRET": "a"}, "UNBROKEN_JOB_SECRET is too weak"),
])
def test_bad_values_exit_2_before_any_worker(tmp_path, flags, env, expected):
    result = run_cli(["run", "--run-dir", str(tmp_path / "run"), *flags, str(EXAMPLE)], env=env, timeout_s=60)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert expected in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "events.jsonl").exists(), "a worker or controller was started"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("key, value", [("UNBROKEN_CONTROLLER", "garbage"), ("UNBROKEN_PG_TIMEOUT_S", "inf"),
                                        ("UNBROKEN_DATA_RANKS", "0,9"), ("UNBROKEN_DATA_RANKS", "0;1")])
def test_managed_worker_with_a_bad_environment_exits_fatal_without_a_traceback(tmp_path, key, value):
    env = dict(os.environ, UNBROKEN_CONTROLLER="127.0.0.1:1", UNBROKEN_JOB_SECRET=STRONG, RANK="0", WORLD_SIZE="1")
    env[key] = value
    script = "import unbroken; unbroken.init(); print('started')"
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == EXIT_FATAL, proc.stderr[-2000:]
    assert f"environment variable {key}" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "started" not in proc.stdout
