"""Fixtures: a real etcd of 1 member (``etcd1``) or 3 (``etcd3``), killed and its data removed after the test."""

from __future__ import annotations

import shutil

import pytest

from tests.etcd_cluster import EtcdCluster


def _cluster(tmp_path, size: int):
    root = tmp_path / "etcd"
    root.mkdir()
    cluster = EtcdCluster(root, size)
    try:
        yield cluster
    finally:
        cluster.close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def etcd1(tmp_path):
    yield from _cluster(tmp_path, 1)


@pytest.fixture
def etcd3(tmp_path):
    yield from _cluster(tmp_path, 3)
