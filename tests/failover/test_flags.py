"""--controller-store and --controller-lease-s are checked at the edge, with messages that say what to do."""

from __future__ import annotations

import pytest

from tests.conftest import EXAMPLE
from unbroken.cli.main import build_parser, launch_config
from unbroken.errors import ConfigError

SECRET = "flags-test-secret-0123456789abcdefghijkl"
MULTI = ["--nnodes", "2", "--master-port", "29400", "--rdzv-id", "job1"]


def config(monkeypatch, *flags):
    monkeypatch.setenv("UNBROKEN_JOB_SECRET", SECRET)
    return launch_config(build_parser().parse_args(["run", *flags, str(EXAMPLE)]))


def test_off_by_default(monkeypatch):
    assert config(monkeypatch, *MULTI).controller_store == ""


def test_a_good_store_is_kept(monkeypatch):
    cfg = config(monkeypatch, *MULTI, "--controller-store", "etcd://10.0.0.1:2379,10.0.0.2:2379",
                 "--controller-lease-s", "3")
    assert cfg.controller_store == "etcd://10.0.0.1:2379,10.0.0.2:2379" and cfg.controller_lease_s == 3


@pytest.mark.parametrize("flags, expected", [
    (["--controller-store", "10.0.0.1:2379"], "expected etcd://HOST:PORT"),
    (["--controller-store", "etcd://10.0.0.1"], "is not HOST:PORT"),
    (["--controller-store", "etcd://h:1", "--controller-lease-s", "0"], "--controller-lease-s must be whole seconds"),
])
def test_bad_values_name_the_flag(monkeypatch, flags, expected):
    with pytest.raises(ConfigError, match=expected):
        config(monkeypatch, *MULTI, *flags)


def test_a_single_node_job_needs_no_etcd(monkeypatch):
    with pytest.raises(ConfigError, match="for a job of several nodes"):
        config(monkeypatch, "--controller-store", "etcd://127.0.0.1:2379")


def test_the_job_id_names_the_keys(monkeypatch):
    with pytest.raises(ConfigError, match="--rdzv-id"):
        config(monkeypatch, "--nnodes", "2", "--master-port", "29400", "--controller-store", "etcd://127.0.0.1:2379")
