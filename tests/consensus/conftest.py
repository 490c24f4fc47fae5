"""Fixtures: a real etcd of 1 member (``etcd1``) or 3 members (``etcd3``), killed after the test."""

from __future__ import annotations

import pytest

from tests.etcd_cluster import EtcdCluster


@pytest.fixture
def etcd1(tmp_path):
    cluster = EtcdCluster(tmp_path, 1)
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def etcd3(tmp_path):
    cluster = EtcdCluster(tmp_path, 3)
    try:
        yield cluster
    finally:
        cluster.close()
