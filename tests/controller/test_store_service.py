"""The rendezvous store served over the control plane (issue 11 item 1): the controller's
StoreService behind a real protocol server, reached by real ControlStore clients and raw
connections; gloo builds real groups over it."""

from __future__ import annotations

import socket
import struct
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from unbroken.controller.store_service import StoreService
from unbroken.errors import AuthError
from unbroken.protocol import messages as m
from unbroken.protocol.wire import Server, connect
from unbroken.worker.store_client import ControlStore

SECRET = b"s3cret-of-this-test-0123456789abcdef"


@pytest.fixture
def service():
    """A StoreService on a control server of its own (the controller routes role "store" to it)."""
    svc = StoreService()
    svc.open_attempt(0)
    server = Server("127.0.0.1", 0, SECRET, svc.serve)
    server.start()
    stores: list[ControlStore] = []

    def client(*, attempt: int = 0, timeout_s: float = 5.0, secret: bytes = SECRET, prefix: str = "") -> ControlStore:
        store = ControlStore("127.0.0.1", server.port, secret, rank=len(stores), attempt=attempt, pid=0,
                             timeout_s=timeout_s, key_prefix=prefix)
        stores.append(store)
        return store

    svc.client, svc.port = client, server.port
    yield svc
    for store in stores:
        store.close()
    svc.close()
    server.close()


def test_the_operations_behave_like_a_tcpstore(service):
    store = service.client()
    store.set("a", b"1")
    store.set("s", "text")
    assert store.get("a") == b"1" and store.get("s") == b"text"
    assert store.add("n", 5) == 5 and store.add("n", -2) == 3 and store.get("n") == b"3"
    assert store.compare_set("cs", b"", b"first") == b"first"
    assert store.compare_set("cs", b"wrong", b"x") == b"first"
    assert store.compare_set("cs", b"first", b"second") == b"second"
    assert store.compare_set("missing", b"exp", b"x") == b"exp" and not store.check(["missing"])
    assert store.check(["a", "s"]) and not store.check(["a", "nope"])
    store.append("ap", b"x")
    store.append("ap", b"y")
    store.multi_set(["m1", "m2"], [b"v1", b"v2"])
    assert store.multi_get(["m1", "m2", "ap"]) == [b"v1", b"v2", b"xy"]
    n = store.num_keys()
    assert store.delete_key("a") and not store.delete_key("a") and store.num_keys() == n - 1
    with pytest.raises(dist.DistStoreError, match="does not list"):
        store.list_keys()


def test_a_blocked_get_is_answered_once_another_client_sets_the_key(service):
    reader, writer = service.client(), service.client()
    got: list[bytes] = []
    thread = threading.Thread(target=lambda: got.append(reader.get("late")))
    thread.start()
    time.sleep(0.2)
    assert not got
    writer.set("late", b"here")
    thread.join(timeout=5)
    assert got == [b"here"]
    writer.set("k2", b"v")
    reader.wait(["k2"])  # already set: returns at once


def test_get_and_wait_time_out_with_a_clear_error(service):
    store = service.client(timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match=r"not set within 0.3 s"):
        store.get("never")
    assert 0.25 <= time.monotonic() - started < 3
    with pytest.raises(dist.DistStoreError, match="not set within 0.2 s"):
        store.wait(["never"], timedelta(seconds=0.2))
    store.set("after", b"ok")  # the connection still serves
    assert store.get("after") == b"ok"


def test_a_wrong_secret_is_refused(service):
    with pytest.raises(AuthError, match="wrong job secret"):
        service.client(secret=b"not-the-secret-of-this-job-xxxxxxxx")
    assert service.keys_of(0) == {}


def test_malformed_requests_get_an_error_and_the_service_keeps_serving(service):
    conn = connect("127.0.0.1", service.port, SECRET, "store", {"attempt": 0})
    try:
        bad_frames = [
            {"type": "store_request", "id": "one", "op": "get"},  # wrong type
            {"type": "store_request"},  # fields missing
            {"type": "store_request", "id": 1, "op": "get", "keys": ["k"], "extra": 1},  # unknown field
            {"type": "heartbeat", "rank": 0},  # not a store request
            {"type": "no_such_type"},
        ]
        for frame in bad_frames:
            conn.send_frame(frame)
            reply = conn.recv(timeout_s=5)
            assert isinstance(reply, m.StoreReply) and reply.id == -1 and not reply.ok and reply.error
        for req in [m.StoreRequest(id=7, op="list_keys"), m.StoreRequest(id=8, op="set", keys=["k"]),
                    m.StoreRequest(id=9, op="get", keys=[]), m.StoreRequest(id=10, op="add", keys=[""])]:
            conn.send(req)
            reply = conn.recv(timeout_s=5)
            assert (reply.id, reply.ok) == (req.id, False) and reply.error
        conn.send(m.StoreRequest(id=11, op="set", keys=["k"], values=[b"v"]))
        assert conn.recv(timeout_s=5) == m.StoreReply(id=11, ok=True)
    finally:
        conn.close()
    assert service.client().get("k") == b"v"


def test_oversized_values_keys_and_requests_are_refused(service, monkeypatch):
    store = service.client()
    with pytest.raises(dist.DistStoreError, match=f"at most {m.STORE_MAX_VALUE_BYTES}"):
        store.set("big", b"x" * (m.STORE_MAX_VALUE_BYTES + 1))
    with pytest.raises(dist.DistStoreError, match=f"allowed: 1..{m.STORE_MAX_KEY_CHARS}"):
        store.set("k" * (m.STORE_MAX_KEY_CHARS + 1), b"v")
    with pytest.raises(dist.DistStoreError, match="keys in one request"):
        store.check([f"k{i}" for i in range(m.STORE_MAX_KEYS_PER_REQUEST + 1)])
    monkeypatch.setattr(m, "STORE_MAX_KEYS", 3)
    for i in range(3):
        store.set(f"k{i}", b"v")
    with pytest.raises(dist.DistStoreError, match="holds 3 keys already"):
        store.set("k3", b"v")
    store.set("k0", b"overwriting an existing key is fine")
    assert "big" not in service.keys_of(0)


def test_two_attempts_are_isolated(service):
    old = service.client(attempt=0)
    old.set("gen0//0/0", b"old address")
    service.open_attempt(1)
    new = service.client(attempt=1, timeout_s=0.3)
    with pytest.raises(dist.DistStoreError, match="not set within"):
        new.get("gen0//0/0")
    with pytest.raises(dist.DistStoreError, match="attempt 0 is over"):
        old.set("gen0//0/1", b"from an older attempt")
    new.set("gen0//0/1", b"new address")
    assert service.keys_of(1) == {"gen0//0/1": b"new address"}


def test_a_blocked_get_of_an_older_attempt_fails_when_the_next_attempt_starts(service):
    old = service.client(attempt=0, timeout_s=30)
    errors: list[Exception] = []

    def get() -> None:
        try:
            old.get("never")
        except dist.DistStoreError as exc:
            errors.append(exc)

    thread = threading.Thread(target=get)
    thread.start()
    time.sleep(0.2)
    service.open_attempt(1)
    thread.join(timeout=5)
    assert errors and "attempt 1 started" in str(errors[0])


@pytest.mark.timeout(60)
def test_gloo_builds_groups_over_the_store(service):
    """Two ranks (threads) build generation groups over PrefixStores of their ControlStores."""
    stores = [service.client(prefix="rdzv-test") for _ in range(2)]
    results: dict[tuple[int, int], torch.Tensor] = {}

    def rank_main(rank: int) -> None:
        for gen in range(2):
            pg = dist.ProcessGroupGloo(dist.PrefixStore(f"gen{gen}/", stores[rank]), rank, 2, timedelta(seconds=20))
            t = torch.full((4,), float(rank + 1 + gen))
            pg.allreduce([t]).wait()
            results[(rank, gen)] = t

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=50)
    assert all(torch.equal(results[(r, g)], torch.full((4,), 3.0 + 2 * g)) for r in range(2) for g in range(2))
    assert all(key.startswith("rdzv-test/gen") for key in service.keys_of(0))


@pytest.mark.parametrize("how", ["close", "reset"])
def test_a_connection_whose_client_went_away_ends_its_serving_thread(how):
    """A lost rank's store connection: its thread ends. It used to loop on the closed socket,
    answering each EOF as a malformed request, a core's worth of the controller's CPU for the
    rest of the job after every lost rank."""
    svc = StoreService()
    svc.open_attempt(0)
    ended, loops = threading.Event(), []
    real_serve_one = svc._serve_one

    def counting(conn, attempt):
        loops.append(1)
        real_serve_one(conn, attempt)

    svc._serve_one = counting

    def serve(conn):
        try:
            svc.serve(conn)
        finally:
            ended.set()

    server = Server("127.0.0.1", 0, SECRET, serve)
    server.start()
    try:
        conn = connect("127.0.0.1", server.port, SECRET, "store", {"rank": 0, "attempt": 0, "pid": 0})
        conn.send(m.StoreRequest(id=1, op="set", keys=["k"], values=[b"v"]))
        assert conn.recv(timeout_s=5).ok
        if how == "reset":  # a SIGKILLed process's socket: RST instead of FIN
            conn._sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()
        assert ended.wait(5), f"the serving thread still runs after the client left ({len(loops)} loops)"
        assert len(loops) < 20
    finally:
        svc.close()
        server.close()


# -- the blocked-request index, in process (no sockets) -------------------------------------------
class _Conn:
    peer = "test"

    def __init__(self) -> None:
        self.closed = False
        self.sent: list[m.StoreReply] = []

    def send(self, reply: m.StoreReply) -> None:
        self.sent.append(reply)


def _req(rid: int, op: str, keys: list[str], values: list[bytes] = (), timeout_ms: int = 60_000) -> m.StoreRequest:
    return m.StoreRequest(id=rid, op=op, keys=keys, values=list(values), timeout_ms=timeout_ms)


def test_a_request_blocked_on_several_keys_is_answered_once_all_are_set_whatever_the_order():
    svc = StoreService()
    svc.open_attempt(0)
    waiter, writer = _Conn(), _Conn()
    assert svc.handle(waiter, 0, _req(1, "multi_get", ["a", "b", "c"])) == []
    assert [r.id for _, r in svc.handle(writer, 0, _req(2, "set", ["c"], [b"3"]))] == [2]
    assert [r.id for _, r in svc.handle(writer, 0, _req(3, "set", ["a"], [b"1"]))] == [3]
    svc.handle(writer, 0, _req(4, "delete_key", ["c"]))  # missing again: the request stays blocked
    assert [r.id for _, r in svc.handle(writer, 0, _req(5, "set", ["b"], [b"2"]))] == [5]
    replies = svc.handle(writer, 0, _req(6, "set", ["c"], [b"33"]))
    (conn, answer) = next((c, r) for c, r in replies if r.id == 1)
    assert conn is waiter and answer.ok and answer.values == [b"1", b"2", b"33"]


def test_one_write_answers_every_request_blocked_on_its_key_and_only_those():
    svc = StoreService()
    svc.open_attempt(0)
    waiters = [_Conn() for _ in range(50)]
    for i, conn in enumerate(waiters):
        svc.handle(conn, 0, _req(i, "wait" if i % 2 else "get", ["k"]))
    other = _Conn()
    svc.handle(other, 0, _req(99, "get", ["other"]))
    replies = svc.handle(_Conn(), 0, _req(100, "set", ["k"], [b"v"]))
    answered = {r.id: c for c, r in replies if r.id != 100}
    assert sorted(answered) == list(range(50)) and all(answered[i] is waiters[i] for i in range(50))
    assert svc.handle(_Conn(), 0, _req(101, "set", ["k"], [b"w"]))[1:] == []  # nobody is answered twice


def test_an_expired_request_is_answered_once_and_forgotten():
    svc = StoreService()
    svc.open_attempt(0)
    conn = _Conn()
    svc.handle(conn, 0, _req(1, "get", ["late"], timeout_ms=1))
    time.sleep(0.01)
    svc._expire(conn, 0)  # what the connection's serving thread does between requests
    assert [(r.id, r.timed_out) for r in conn.sent] == [(1, True)]
    replies = svc.handle(_Conn(), 0, _req(2, "set", ["late"], [b"x"]))
    assert [r.id for _, r in replies] == [2]  # the timed-out get gets no second reply
    for i in range(m.STORE_MAX_WAITS):  # and no longer counts against its connection's limit
        assert svc.handle(conn, 0, _req(10 + i, "get", [f"never{i}"])) == []
    (refused,) = svc.handle(conn, 0, _req(999, "get", ["one-more"]))
    assert not refused[1].ok and "blocked" in refused[1].error
