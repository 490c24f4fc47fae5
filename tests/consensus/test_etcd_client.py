"""The etcd client: pure parts without etcd, the calls against a real etcd member."""

from __future__ import annotations

import time

import pytest

from unbroken.consensus.etcd import Compare, EtcdClient, EtcdError, EtcdUnavailable, Put, parse_endpoints, prefix_end
from unbroken.errors import ConfigError
from tests.conftest import free_port

pytestmark = pytest.mark.timeout(60)


def test_parse_endpoints():
    assert parse_endpoints("etcd://127.0.0.1:2379,10.0.0.2:2380") == [("127.0.0.1", 2379), ("10.0.0.2", 2380)]
    for bad in ("127.0.0.1:2379", "https://h:1", "etcd://host", "etcd://h:1/path"):
        with pytest.raises(ConfigError, match="--controller-store"):
            parse_endpoints(bad)


def test_prefix_end():
    assert prefix_end(b"/a/") == b"/a0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff") == b"\0"


def test_no_member_answers():
    client = EtcdClient([("127.0.0.1", free_port()), ("127.0.0.1", free_port())], timeout_s=0.5)
    with pytest.raises(EtcdUnavailable, match="no etcd member answered"):
        client.get(b"k")


def test_kv_txn_and_lease(etcd1):
    client = EtcdClient(etcd1.endpoints)
    assert client.get(b"/t/a") is None
    rev = client.put(b"/t/a", b"1")
    kv = client.get(b"/t/a")
    assert (kv.value, kv.create_revision, kv.mod_revision) == (b"1", rev, rev)
    client.put(b"/t/b", b"2")
    assert [kv.key for kv in client.get_prefix(b"/t/")] == [b"/t/a", b"/t/b"]
    # create-if-absent: the second attempt fails and reads back the first one's value
    first = client.txn([Compare(b"/t/c", "CREATE", 0)], [Put(b"/t/c", b"x")], failure_reads=[b"/t/c"])
    second = client.txn([Compare(b"/t/c", "CREATE", 0)], [Put(b"/t/c", b"y")], failure_reads=[b"/t/c"])
    assert first.succeeded and not second.succeeded
    assert [kv.value for kv in second.kvs] == [b"x"]
    # a key bound to a lease disappears with it
    lease = client.grant(1)
    client.put(b"/t/leased", b"v", lease=lease)
    assert client.keepalive(lease) == 1
    deadline = time.monotonic() + 5
    while client.get(b"/t/leased") is not None:
        assert time.monotonic() < deadline, "a 1 s lease did not expire within 5 s"
        time.sleep(0.1)
    assert client.keepalive(lease) == 0  # expired: etcd says TTL 0
    client.revoke(lease)  # unknown lease: not an error
    client.delete(b"/t/a")
    assert client.get(b"/t/a") is None


def test_refused_request_is_an_error(etcd1):
    client = EtcdClient(etcd1.endpoints)
    with pytest.raises(EtcdError, match="lease not found"):
        client.put(b"/t/x", b"v", lease=12345)


def test_fails_over_to_a_live_member(etcd1):
    dead = ("127.0.0.1", free_port())
    client = EtcdClient([dead, *etcd1.endpoints], timeout_s=1.0)
    client.put(b"/t/f", b"1")
    assert client.get(b"/t/f").value == b"1"
