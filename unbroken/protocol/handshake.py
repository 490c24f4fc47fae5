"""The control connection handshake: HMAC-SHA256 challenge-response with the job secret.

Each side proves it holds the secret, so a wrong secret is refused by the server and a
client never talks to an impostor server:

    server -> {"type": "challenge", "version": 1, "nonce": Ns}
    client -> {"type": "hello", "version": 1, "role": str, "ident": dict, "nonce": Nc,
               "mac": HMAC(secret, "unbroken-hello\\0" + Ns + Nc + canonical(role, ident))}
    server -> {"type": "welcome", "version": 1,
               "mac": HMAC(secret, "unbroken-welcome\\0" + Nc + Ns)}
           or {"type": "reject", "code": "auth" | "version" | "protocol", "reason": str}, close

The two MACs carry distinct labels so that one can never be replayed as the other. Both
functions run in the caller's thread and raise AuthError (wrong secret), ProtocolError
(version mismatch, malformed frame, timeout) or ConnectionClosed.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from typing import Any, Protocol

import msgpack

from unbroken.errors import AuthError, ProtocolError
from unbroken.protocol.messages import PROTOCOL_VERSION



class Connection(Protocol):
    """What the handshake needs of a :class:`unbroken.protocol.wire.Connection` (not imported:
    the wire imports this module)."""

    peer: str
    role: str
    ident: dict[str, Any]

    def send_frame(self, obj: Any) -> None: ...

    def recv_frame(self, timeout_s: float | None = None) -> Any: ...

NONCE_BYTES = 32
SECRET_HINT = "set UNBROKEN_JOB_SECRET to the job's secret"

_HELLO_LABEL = b"unbroken-hello\x00"
_WELCOME_LABEL = b"unbroken-welcome\x00"


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"".join(parts), hashlib.sha256).digest()


def _canonical(role: str, ident: dict[str, Any]) -> bytes:
    """Bytes both ends derive identically from role and ident (map keys sorted)."""

    def ordered(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: ordered(value[k]) for k in sorted(value)}
        if isinstance(value, list):
            return [ordered(v) for v in value]
        return value

    try:
        return msgpack.packb([role, ordered(ident)], use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(
            f"ident {ident!r} must be a map of str keys to msgpack-able values: {exc}"
        ) from None


def _handshake_frame(
    conn: Connection, where: str, deadline: float, timeout_s: float
) -> dict[str, Any]:
    try:
        return conn.recv_frame(max(deadline - time.monotonic(), 0.0))
    except TimeoutError:
        raise ProtocolError(f"{where}: handshake timed out after {timeout_s} s") from None


def _reject(conn: Connection, code: str, reason: str) -> None:
    try:
        conn.send_frame({"type": "reject", "code": code, "reason": reason})
    except ProtocolError:
        pass  # the peer is gone already; the caller raises the real error


def server_handshake(conn: Connection, secret: bytes, timeout_s: float) -> None:
    """Authenticate the client on `conn`, then set its role and ident. Raises on failure."""
    where = f"control connection from {conn.peer}"
    deadline = time.monotonic() + timeout_s
    nonce = secrets.token_bytes(NONCE_BYTES)
    conn.send_frame({"type": "challenge", "version": PROTOCOL_VERSION, "nonce": nonce})
    hello = _handshake_frame(conn, where, deadline, timeout_s)
    version = hello.get("version")
    if hello.get("type") == "hello" and version != PROTOCOL_VERSION:
        reason = (
            f"this controller speaks protocol version {PROTOCOL_VERSION}, the client {version!r}"
        )
        _reject(conn, "version", reason)
        raise ProtocolError(
            f"{where} rejected: {reason}; run the same unbroken version on every node"
        )
    role, ident, client_nonce, mac = (hello.get(k) for k in ("role", "ident", "nonce", "mac"))
    well_formed = (
        hello.get("type") == "hello"
        and isinstance(role, str)
        and bool(role)
        and isinstance(ident, dict)
        and isinstance(client_nonce, bytes)
        and len(client_nonce) == NONCE_BYTES
        and isinstance(mac, bytes)
    )
    if not well_formed:
        _reject(conn, "protocol", "expected a hello frame")
        keys = sorted(map(str, hello))
        raise ProtocolError(f"{where} rejected: expected a hello frame, got keys {keys}")
    expected = _mac(secret, _HELLO_LABEL, nonce, client_nonce, _canonical(role, ident))
    if not hmac.compare_digest(mac, expected):
        _reject(conn, "auth", "wrong job secret")
        raise AuthError(f"{where} (role {role!r}) rejected: wrong job secret ({SECRET_HINT})")
    conn.role, conn.ident = role, ident
    welcome_mac = _mac(secret, _WELCOME_LABEL, client_nonce, nonce)
    conn.send_frame({"type": "welcome", "version": PROTOCOL_VERSION, "mac": welcome_mac})


def client_handshake(conn: Connection, secret: bytes, timeout_s: float) -> None:
    """Authenticate to the server on `conn` and check that it holds the secret too."""
    where = f"control connection to {conn.peer}"
    deadline = time.monotonic() + timeout_s
    challenge = _handshake_frame(conn, where, deadline, timeout_s)
    if challenge.get("type") != "challenge":
        raise ProtocolError(
            f"{where}: expected a challenge, got {challenge.get('type')!r}; "
            "is it an unbroken controller?"
        )
    version = challenge.get("version")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"{where}: the server speaks protocol version {version!r}, this process speaks "
            f"version {PROTOCOL_VERSION}; run the same unbroken version on every node"
        )
    server_nonce = challenge.get("nonce")
    if not isinstance(server_nonce, bytes) or len(server_nonce) != NONCE_BYTES:
        raise ProtocolError(f"{where}: malformed challenge (nonce must be {NONCE_BYTES} bytes)")
    client_nonce = secrets.token_bytes(NONCE_BYTES)
    mac = _mac(secret, _HELLO_LABEL, server_nonce, client_nonce, _canonical(conn.role, conn.ident))
    conn.send_frame(
        {"type": "hello", "version": PROTOCOL_VERSION, "role": conn.role, "ident": conn.ident,
         "nonce": client_nonce, "mac": mac}
    )
    reply = _handshake_frame(conn, where, deadline, timeout_s)
    if reply.get("type") == "reject":
        if reply.get("code") == "auth":
            raise AuthError(f"{where} rejected: wrong job secret ({SECRET_HINT})")
        raise ProtocolError(f"{where} rejected: {reply.get('reason')!s}")
    if reply.get("type") != "welcome":
        raise ProtocolError(f"{where}: expected welcome or reject, got {reply.get('type')!r}")
    server_mac = reply.get("mac")
    expected = _mac(secret, _WELCOME_LABEL, client_nonce, server_nonce)
    if not isinstance(server_mac, bytes) or not hmac.compare_digest(server_mac, expected):
        raise AuthError(
            f"{where}: the server failed authentication (it does not hold the job secret), "
            f"refusing to talk to it ({SECRET_HINT} on both sides)"
        )
