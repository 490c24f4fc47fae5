"""Framing, the authenticated handshake, Connection and Server, over real sockets.

Every server listens on 127.0.0.1 port 0; every socket is closed by the test that made it.
"""

import logging
import queue
import socket
import struct
import threading
import time
from collections.abc import Iterator

import msgpack
import pytest

from unbroken.errors import AuthError, ConfigError, ConnectionClosed, ProtocolError
from unbroken.protocol import handshake
from unbroken.protocol.messages import FaultClaim, Heartbeat, Progress, StartRanks, RankExited
from unbroken.protocol.wire import (
    MAX_FRAME_BYTES,
    Connection,
    FrameReader,
    Server,
    connect,
    new_secret,
    pack_frame,
    secret_from_text,
)

SECRET = b"the-job-secret"
HOST = "127.0.0.1"


# ---------------------------------------------------------------- helpers


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


class Recorder:
    """Server handler: greets the client, then acks every message it receives."""

    def __init__(self) -> None:
        self.received: queue.Queue = queue.Queue()

    def __call__(self, conn: Connection) -> None:
        conn.send(StartRanks(attempt=0, store_host=HOST, store_port=1, world_size=2))
        while True:
            msg = conn.recv()
            self.received.put((conn.role, conn.ident, msg))
            conn.send(FaultClaim(fault_id=msg.TYPE, granted=True))


@pytest.fixture
def server() -> Iterator[tuple[Server, Recorder]]:
    recorder = Recorder()
    srv = Server(HOST, 0, SECRET, recorder, handshake_timeout_s=0.5)
    srv.start()
    yield srv, recorder
    srv.close()


def assert_serves_a_good_client(srv: Server) -> None:
    with connect(HOST, srv.port, SECRET, "agent", {"node_rank": 0}) as conn:
        assert isinstance(conn.recv(timeout_s=5), StartRanks)
        conn.send(Heartbeat(rank=0))
        assert conn.recv(timeout_s=5) == FaultClaim(fault_id="heartbeat", granted=True)


def raw_client(port: int) -> tuple[socket.socket, FrameReader]:
    """A socket to the server that has read the challenge and says nothing yet."""
    sock = socket.create_connection((HOST, port), timeout=5)
    reader = FrameReader(sock, "server")
    assert reader.read(timeout_s=5)["type"] == "challenge"
    return sock, reader


def assert_dropped(sock: socket.socket) -> None:
    """The server closes `sock` (after an optional reject frame)."""
    sock.settimeout(5)
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    if data:
        assert msgpack.unpackb(data[4:])["type"] == "reject"


# ---------------------------------------------------------------- framing


@pytest.mark.timeout(20)
def test_frames_cross_a_socketpair_even_byte_by_byte(pair) -> None:
    a, b = pair
    reader = FrameReader(b, "a")
    frame = pack_frame({"type": "x", "n": 1, "blob": b"\x00" * 300})
    assert struct.unpack(">I", frame[:4])[0] == len(frame) - 4
    a.sendall(frame[:3])
    with pytest.raises(TimeoutError):
        reader.read(timeout_s=0.05)  # partial input is kept, not lost

    def dribble() -> None:  # one byte per send, while the reader is reading
        for i in range(3, len(frame)):
            a.sendall(frame[i : i + 1])
        a.sendall(pack_frame({"second": True}))

    sender = threading.Thread(target=dribble)
    sender.start()
    assert reader.read(timeout_s=5) == {"type": "x", "n": 1, "blob": b"\x00" * 300}
    sender.join(timeout=5)
    assert reader.read(timeout_s=0) == {"second": True}


@pytest.mark.timeout(20)
def test_oversized_length_is_refused_before_reading_it(pair) -> None:
    a, b = pair
    reader = FrameReader(b, "a")
    a.sendall(struct.pack(">I", MAX_FRAME_BYTES + 1))  # no body follows: must not wait for it
    with pytest.raises(ProtocolError, match="over the 1048576-byte limit"):
        reader.read(timeout_s=5)
    with pytest.raises(ProtocolError, match="over the 1048576-byte limit"):
        pack_frame({"blob": b"x" * MAX_FRAME_BYTES})


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "payload, text",
    [
        (msgpack.packb([1, 2]), "msgpack list, not a map"),
        (msgpack.packb("hi"), "msgpack str, not a map"),
        (b"\xc1", "malformed control frame"),
        (b"", "malformed control frame"),
        (msgpack.packb({1: 2}), "malformed control frame"),
        (msgpack.packb({"a": msgpack.ExtType(1, b"z")}), "malformed control frame"),
        (b"\x91" * 5000 + b"\xc0", "malformed control frame"),
    ],
)
def test_non_map_or_garbage_payload_is_a_protocol_error(pair, payload: bytes, text: str) -> None:
    a, b = pair
    reader = FrameReader(b, "a")
    a.sendall(struct.pack(">I", len(payload)) + payload + pack_frame({"next": 1}))
    with pytest.raises(ProtocolError, match=text):
        reader.read(timeout_s=5)
    assert reader.read(timeout_s=5) == {"next": 1}  # a whole bad frame keeps the stream in step


@pytest.mark.timeout(20)
def test_eof_is_connection_closed(pair) -> None:
    a, b = pair
    reader = FrameReader(b, "a")
    a.sendall(pack_frame({"n": 1})[:5])
    a.close()
    with pytest.raises(ConnectionClosed, match="in the middle of a frame"):
        reader.read(timeout_s=5)


@pytest.mark.timeout(20)
def test_connection_over_socketpair(pair) -> None:
    a, b = pair
    left, right = Connection(a, "right"), Connection(b, "left")
    msg = RankExited(rank=1, pid=2, attempt=0, exit_code=None, signal=9, last_lines=["boom"])
    left.send(msg)
    left.send({"type": "heartbeat", "rank": 4})
    assert right.recv(timeout_s=5) == msg
    assert right.recv(timeout_s=5) == Heartbeat(rank=4)
    with pytest.raises(TimeoutError):
        right.recv(timeout_s=0.05)
    with pytest.raises(ProtocolError, match="field 'rank' must be int, got str"):
        left.send({"type": "heartbeat", "rank": "4"})  # refused before it leaves
    left.send_frame({"type": "heartbeat", "rank": "4"})
    with pytest.raises(ProtocolError, match="control connection left: message 'heartbeat'"):
        right.recv(timeout_s=5)
    left.send(Heartbeat(rank=5))
    assert right.recv(timeout_s=5) == Heartbeat(rank=5)  # still in step after a bad message
    left.close()
    right.close()


@pytest.mark.timeout(20)
def test_close_wakes_a_blocked_recv_and_send_after_close_fails(pair) -> None:
    a, b = pair
    conn = Connection(b, "a")
    errors: queue.Queue = queue.Queue()

    def reader() -> None:
        try:
            conn.recv()
        except Exception as exc:  # noqa: BLE001 - handed to the test thread
            errors.put(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    time.sleep(0.1)
    conn.close()
    conn.close()  # idempotent
    thread.join(timeout=5)
    assert isinstance(errors.get(timeout=1), ConnectionClosed)
    with pytest.raises(ConnectionClosed):
        conn.send(Heartbeat(rank=0))


@pytest.mark.timeout(20)
def test_concurrent_senders_never_interleave_frames(pair) -> None:
    a, b = pair
    sender, receiver = Connection(a, "b"), Connection(b, "a")
    metrics = {"pad": "x" * 20000}  # big enough that unlocked sendall calls would interleave

    def send_many(rank: int) -> None:
        for step in range(50):
            sender.send(Progress(rank=rank, attempt=0, step=step, phase="train", metrics=metrics))

    threads = [threading.Thread(target=send_many, args=(rank,)) for rank in range(4)]
    for thread in threads:
        thread.start()
    got = [receiver.recv(timeout_s=5) for _ in range(200)]
    for thread in threads:
        thread.join(timeout=5)
    for rank in range(4):
        assert [msg.step for msg in got if msg.rank == rank] == list(range(50))
    sender.close()
    receiver.close()


# ---------------------------------------------------------------- server and client


@pytest.mark.timeout(20)
def test_good_client_exchanges_messages_both_ways(server) -> None:
    srv, recorder = server
    ident = {"node_rank": 2, "host": "n2", "tags": ["a"]}
    with connect(HOST, srv.port, SECRET, "agent", ident) as conn:
        assert conn.peer == f"{HOST}:{srv.port}"
        assert (conn.role, conn.ident) == ("agent", ident)
        assert conn.recv(timeout_s=5) == StartRanks(
            attempt=0, store_host=HOST, store_port=1, world_size=2
        )
        sent = Progress(rank=1, attempt=0, step=9, phase="train", metrics={"loss": 0.5})
        conn.send(sent)
        assert conn.recv(timeout_s=5) == FaultClaim(fault_id="progress", granted=True)
        assert recorder.received.get(timeout=5) == ("agent", ident, sent)


@pytest.mark.timeout(20)
def test_wrong_secret_is_auth_error_and_server_keeps_serving(server, caplog) -> None:
    srv, _ = server
    caplog.set_level(logging.WARNING, logger="unbroken.protocol.wire")
    with pytest.raises(AuthError) as info:
        connect(HOST, srv.port, b"not-the-secret", "agent", {})
    assert str(info.value) == (
        f"control connection to 127.0.0.1:{srv.port} rejected: wrong job secret "
        "(set UNBROKEN_JOB_SECRET to the job's secret)"
    )
    assert_serves_a_good_client(srv)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        "control connection from 127.0.0.1:" in w and "wrong job secret" in w for w in warnings
    )


@pytest.mark.timeout(20)
def test_garbage_bytes_instead_of_hello(server) -> None:
    srv, _ = server
    sock, _ = raw_client(srv.port)
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # "GET " is a 1.2 GB length
    assert_dropped(sock)
    sock.close()
    assert_serves_a_good_client(srv)


@pytest.mark.timeout(20)
def test_oversized_length_instead_of_hello(server) -> None:
    srv, _ = server
    sock, _ = raw_client(srv.port)
    sock.sendall(struct.pack(">I", MAX_FRAME_BYTES + 1))
    assert_dropped(sock)
    sock.close()
    assert_serves_a_good_client(srv)


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "payload", [msgpack.packb([1, 2, 3]), b"\xc1\xc1", msgpack.packb({"type": "hello"})]
)
def test_non_map_or_malformed_hello(server, payload: bytes) -> None:
    srv, _ = server
    sock, _ = raw_client(srv.port)
    sock.sendall(struct.pack(">I", len(payload)) + payload)
    assert_dropped(sock)
    sock.close()
    assert_serves_a_good_client(srv)


@pytest.mark.timeout(20)
def test_silent_client_times_out_of_the_handshake(server) -> None:
    srv, _ = server  # handshake_timeout_s=0.5
    silent, _ = raw_client(srv.port)
    started = time.monotonic()
    assert_serves_a_good_client(srv)  # served while the silent one still hangs on
    assert_dropped(silent)
    assert time.monotonic() - started < 5
    silent.close()


@pytest.mark.timeout(20)
def test_client_that_connects_and_leaves(server) -> None:
    srv, _ = server
    sock = socket.create_connection((HOST, srv.port), timeout=5)
    sock.close()
    assert_serves_a_good_client(srv)


@pytest.mark.timeout(20)
def test_newer_client_version_is_rejected_naming_both(server) -> None:
    srv, _ = server
    sock, reader = raw_client(srv.port)
    sock.sendall(pack_frame({"type": "hello", "version": 2, "role": "agent"}))
    reply = reader.read(timeout_s=5)
    assert reply["type"] == "reject" and reply["code"] == "version"
    assert "version 1" in reply["reason"] and "2" in reply["reason"]
    sock.close()
    assert_serves_a_good_client(srv)


@pytest.mark.timeout(20)
def test_bad_message_or_failing_handler_drops_only_that_connection() -> None:
    def handler(conn: Connection) -> None:
        msg = conn.recv(timeout_s=5)
        if msg == Heartbeat(rank=666):
            raise RuntimeError("handler bug")
        conn.send(FaultClaim(fault_id="fine", granted=True))

    with Server(HOST, 0, SECRET, handler) as srv:
        srv.start()
        for poison in ({"type": "nope"}, {"type": "heartbeat", "rank": 666}):
            with connect(HOST, srv.port, SECRET, "worker", {"rank": 0}) as conn:
                conn.send_frame(poison)
                with pytest.raises(ConnectionClosed):
                    conn.recv(timeout_s=5)
        with connect(HOST, srv.port, SECRET, "worker", {"rank": 1}) as conn:
            conn.send(Heartbeat(rank=1))
            assert conn.recv(timeout_s=5) == FaultClaim(fault_id="fine", granted=True)


@pytest.mark.timeout(20)
def test_server_close_closes_live_connections_and_is_idempotent() -> None:
    handler_started = threading.Event()

    def handler(conn: Connection) -> None:
        handler_started.set()
        conn.recv()

    srv = Server(HOST, 0, SECRET, handler)
    srv.start()
    conn = connect(HOST, srv.port, SECRET, "agent", {})
    assert handler_started.wait(timeout=5)
    srv.close()
    srv.close()
    with pytest.raises(ConnectionClosed):
        conn.recv(timeout_s=5)
    conn.close()
    with pytest.raises(ConnectionClosed):
        connect(HOST, srv.port, SECRET, "agent", {}, timeout_s=0.3)


@pytest.mark.timeout(20)
def test_connect_retries_until_the_server_listens() -> None:
    probe = socket.socket()
    probe.bind((HOST, 0))
    port = probe.getsockname()[1]
    probe.close()  # nobody listens on `port` now
    servers: list[Server] = []

    def start_late() -> None:
        time.sleep(0.4)
        srv = Server(HOST, port, SECRET, lambda conn: conn.send(FaultClaim(fault_id="late", granted=True)))
        servers.append(srv)
        srv.start()

    thread = threading.Thread(target=start_late)
    thread.start()
    try:
        with connect(HOST, port, SECRET, "agent", {}, timeout_s=5) as conn:
            assert conn.recv(timeout_s=5) == FaultClaim(fault_id="late", granted=True)
    finally:
        thread.join(timeout=5)
        for srv in servers:
            srv.close()


# ---------------------------------------------------------------- impostor servers


def fake_server(behaviour) -> tuple[socket.socket, threading.Thread]:
    """A listener on port 0 whose one connection is served by `behaviour(conn)`."""
    listener = socket.create_server((HOST, 0))

    def serve() -> None:
        sock, addr = listener.accept()
        with Connection(sock, f"{addr[0]}:{addr[1]}") as conn:
            try:
                behaviour(conn)
                conn.recv_frame(timeout_s=5)  # wait for the client to hang up
            except (ProtocolError, TimeoutError):
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


def impostor_welcome(secret: bytes, with_mac: bool = True):
    def behaviour(conn: Connection) -> None:
        nonce = b"n" * 32
        conn.send_frame({"type": "challenge", "version": 1, "nonce": nonce})
        hello = conn.recv_frame(timeout_s=5)
        mac = handshake._mac(secret, handshake._WELCOME_LABEL, hello["nonce"], nonce)
        conn.send_frame({"type": "welcome", "version": 1, **({"mac": mac} if with_mac else {})})

    return behaviour


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "behaviour",
    [impostor_welcome(b"wrong-secret"), impostor_welcome(SECRET, with_mac=False)],
    ids=["wrong-secret", "no-proof"],
)
def test_client_refuses_a_server_without_the_secret(behaviour) -> None:
    listener, thread = fake_server(behaviour)
    port = listener.getsockname()[1]
    text = f"control connection to 127.0.0.1:{port}: the server failed authentication"
    with pytest.raises(AuthError, match=text):
        connect(HOST, port, SECRET, "agent", {})
    thread.join(timeout=5)
    listener.close()


@pytest.mark.timeout(20)
def test_client_refuses_another_protocol_version() -> None:
    listener, thread = fake_server(
        lambda conn: conn.send_frame({"type": "challenge", "version": 7, "nonce": b"n" * 32})
    )
    text = "server speaks protocol version 7, this process speaks version 1"
    with pytest.raises(ProtocolError, match=text):
        connect(HOST, listener.getsockname()[1], SECRET, "agent", {})
    thread.join(timeout=5)
    listener.close()


@pytest.mark.timeout(20)
def test_client_handshake_times_out_on_a_silent_server() -> None:
    listener, thread = fake_server(lambda conn: None)
    started = time.monotonic()
    with pytest.raises(ProtocolError, match="handshake timed out"):
        connect(HOST, listener.getsockname()[1], SECRET, "agent", {}, timeout_s=0.3)
    assert time.monotonic() - started < 3
    thread.join(timeout=6)
    listener.close()


# ---------------------------------------------------------------- secrets and arguments


@pytest.mark.timeout(20)
def test_secrets() -> None:
    first, second = new_secret(), new_secret()
    assert first != second and len(first) == 64 and int(first, 16) >= 0
    assert secret_from_text(f"  {first}\n") == first.encode()
    with pytest.raises(ConfigError, match="UNBROKEN_JOB_SECRET"):
        secret_from_text(" \n")
    with pytest.raises(ConfigError, match="non-empty bytes"):
        Server(HOST, 0, "text", lambda conn: None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="non-empty bytes"):
        connect(HOST, 1, b"", "agent", {})


@pytest.mark.timeout(20)
def test_busy_port_is_a_config_error() -> None:
    with Server(HOST, 0, SECRET, lambda conn: None) as first:
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{first.port}"):
            Server(HOST, first.port, SECRET, lambda conn: None)
