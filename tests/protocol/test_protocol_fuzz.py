"""Hostile control-plane input: nesting bombs, floods of failed handshakes, random and mutated
frames. Nothing crashes the server or the decoder, nothing authenticates without the secret."""

from __future__ import annotations

import logging
import socket
import struct

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unbroken.errors import AuthError, ConnectionClosed, ProtocolError
from unbroken.protocol import handshake
from unbroken.protocol.messages import decode
from unbroken.protocol.wire import Server, connect, unpack_payload

from tests.protocol.test_protocol_wire import HOST, SECRET, Recorder, assert_dropped, assert_serves_a_good_client, raw_client

NESTED_HELLO_DEPTH = 1000


def _nested_map_bytes(depth: int) -> bytes:
    """msgpack of {"a": {"a": ... nil}} `depth` maps deep (msgpack's packer refuses to build it)."""
    return b"\x81\xa1a" * depth + b"\xc0"


def _hello_with_ident(raw_ident: bytes) -> bytes:
    head = msgpack.packb({"type": "hello", "version": 1, "role": "agent", "nonce": b"n" * 32, "mac": b"m" * 32})
    body = bytes([head[0] + 1]) + head[1:] + msgpack.packb("ident") + raw_ident  # a 6th entry: ident
    return struct.pack(">I", len(body)) + body


@pytest.mark.timeout(30)
def test_a_deeply_nested_ident_is_refused_before_any_recursion(caplog):
    caplog.set_level(logging.WARNING)
    with Server(HOST, 0, SECRET, Recorder(), handshake_timeout_s=2) as srv:
        srv.start()
        sock, _ = raw_client(srv.port)
        sock.sendall(_hello_with_ident(_nested_map_bytes(NESTED_HELLO_DEPTH)))
        assert_dropped(sock)
        sock.close()
        assert_serves_a_good_client(srv)
    text = caplog.text
    assert "RecursionError" not in text and "Traceback" not in text
    assert "nested deeper than" in text


@pytest.mark.timeout(60)
def test_a_flood_of_failed_handshakes_logs_one_warning_and_is_counted(caplog):
    caplog.set_level(logging.WARNING, logger="unbroken.protocol.wire")
    reported: list[int] = []
    with Server(HOST, 0, SECRET, Recorder(), handshake_timeout_s=2,
                on_failed_handshakes=lambda count, last: reported.append(count)) as srv:
        srv.start()
        for _ in range(40):
            sock, _ = raw_client(srv.port)
            sock.sendall(b"\x00\x00\x00\x02\x92\x01")  # an array, not a map
            assert_dropped(sock)
            sock.close()
        with pytest.raises(AuthError):
            connect(HOST, srv.port, b"not-the-secret", "agent", {"node_rank": 0}, timeout_s=5)
        assert_serves_a_good_client(srv)
    warnings = [r for r in caplog.records if "failed the handshake" in r.getMessage()]
    assert 1 <= len(warnings) <= 2, [r.getMessage() for r in warnings]  # the first, then one summary at close
    assert sum(reported) == 41


class _ScriptedConn:
    """The two frame calls server_handshake makes, fed by a test (no socket)."""

    def __init__(self, make_hello) -> None:
        self.peer, self.role, self.ident = "fuzz", None, None
        self._make_hello, self.sent = make_hello, []

    def send_frame(self, obj) -> None:
        self.sent.append(obj)

    def recv_frame(self, timeout_s=None):
        return self._make_hello(self.sent[0]["nonce"])


def _valid_hello(nonce: bytes, ident: dict) -> dict:
    client_nonce = b"c" * handshake.NONCE_BYTES
    mac = handshake._mac(SECRET, handshake._HELLO_LABEL, nonce, client_nonce, handshake._canonical("agent", ident))
    return {"type": "hello", "version": 1, "role": "agent", "ident": ident, "nonce": client_nonce, "mac": mac}


FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.binary(max_size=2048))
def test_random_payloads_only_ever_raise_protocol_errors(payload):
    try:
        obj = unpack_payload(payload)
    except ProtocolError:
        return
    try:
        decode(obj)
    except ProtocolError:
        pass


@FUZZ
@given(ident=st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=8), max_size=4),
       position=st.integers(min_value=0), value=st.integers(min_value=0, max_value=255))
def test_a_mutated_hello_never_authenticates_unless_it_decodes_to_the_same_hello(ident, position, value):
    holder = {}

    def mutated(nonce):
        good = _valid_hello(nonce, ident)
        raw = bytearray(msgpack.packb(good, use_bin_type=True))
        raw[position % len(raw)] = value
        holder["good"] = good
        holder["got"] = unpack_payload(bytes(raw))  # ProtocolError ends the handshake too
        return holder["got"]

    conn = _ScriptedConn(mutated)
    try:
        handshake.server_handshake(conn, SECRET, timeout_s=1)
    except (ProtocolError, AuthError, ConnectionClosed):
        assert conn.role is None
        return
    assert holder["got"] == holder["good"] and conn.role == "agent"


@FUZZ
@given(hello=st.dictionaries(st.sampled_from(["type", "version", "role", "ident", "nonce", "mac", "x"]),
                             st.none() | st.booleans() | st.integers() | st.binary(max_size=40)
                             | st.text(max_size=10) | st.lists(st.integers(), max_size=3)
                             | st.dictionaries(st.text(max_size=3), st.integers(), max_size=3)))
def test_a_random_hello_never_authenticates(hello):
    conn = _ScriptedConn(lambda nonce: dict(hello, type="hello", version=1))
    with pytest.raises((ProtocolError, AuthError)):
        handshake.server_handshake(conn, SECRET, timeout_s=1)
    assert conn.role is None
