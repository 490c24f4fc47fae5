"""Control-plane transport: length-prefixed msgpack frames over TCP, authenticated per job.

Frames (framing.py, re-exported here): 4-byte big-endian payload length, then a msgpack
map, never pickle; at most MAX_FRAME_BYTES, refused from the header alone. Every
connection first runs the HMAC challenge-response of handshake.py: both ends prove they
hold the job secret, so a wrong secret is refused and a client never talks to an impostor.

Threads: a `Connection` may be sent on from any thread; `recv` serialises its callers.
A `Server` runs one accept thread and one thread per connection (handshake, then the
caller's handler); every thread it starts is a daemon.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from typing import Any, Callable

from unbroken.errors import ConfigError, ConnectionClosed, ProtocolError
from unbroken.protocol.framing import (
    MAX_FRAME_BYTES,
    WAKE_S,
    FrameReader,
    pack_frame,
    unpack_payload,
)
from unbroken.protocol.handshake import SECRET_HINT, client_handshake, server_handshake
from unbroken.protocol.messages import Message, decode, encode

logger = logging.getLogger(__name__)

__all__ = [
    "MAX_FRAME_BYTES", "HANDSHAKE_TIMEOUT_S", "Connection", "FrameReader", "Server", "connect",
    "new_secret", "pack_frame", "secret_from_text", "unpack_payload",
]

HANDSHAKE_TIMEOUT_S = 5.0


# ---------------------------------------------------------------- secrets


def new_secret() -> str:
    """A fresh random job secret (64 hex digits) to hand to every process of one job."""
    return secrets.token_hex(32)


def secret_from_text(text: str) -> bytes:
    """The job secret as bytes: `text` without surrounding whitespace, UTF-8 encoded."""
    stripped = text.strip()
    if not stripped:
        raise ConfigError(
            f"the job secret is empty; {SECRET_HINT} (any non-empty text, e.g. 64 hex digits)"
        )
    return stripped.encode("utf-8")


def _check_secret(secret: bytes) -> None:
    if not isinstance(secret, bytes) or not secret:
        raise ConfigError(
            f"the job secret must be non-empty bytes (got {type(secret).__name__}); {SECRET_HINT}"
        )


# ---------------------------------------------------------------- connection


class Connection:
    """One control connection; owns its socket until `close()`.

    `peer` is "host:port" of the other end; `role` and `ident` are the client's, as stated
    in its authenticated hello (the same on both ends). `send` is safe from any thread;
    `recv` callers are serialised; `close` from any thread ends a blocked `recv`.
    """

    def __init__(
        self, sock: socket.socket, peer: str, role: str = "", ident: dict[str, Any] | None = None
    ) -> None:
        sock.settimeout(None)  # blocking; reads wait in poll() so sends never time out midway
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            # Frames are small and latency-bound: do not let Nagle hold them back.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.peer = peer
        self.role = role
        self.ident: dict[str, Any] = dict(ident or {})
        self._sock = sock
        self._closed = threading.Event()
        self._reader = FrameReader(sock, peer, self._closed)
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Connection(peer={self.peer!r}, role={self.role!r}, closed={self.closed})"

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def send(self, msg: Message | dict[str, Any]) -> None:
        """Send one message (a dict must be a valid encoded message); ConnectionClosed if gone."""
        if isinstance(msg, Message):
            obj = encode(msg)
        elif isinstance(msg, dict):
            decode(msg)  # refuse to send what the peer would refuse to read
            obj = msg
        else:
            raise TypeError(f"Connection.send takes a Message or a dict, not {type(msg).__name__}")
        self.send_frame(obj)

    def send_frame(self, obj: dict[str, Any]) -> None:
        """Send one raw frame without message checks (the handshake uses this)."""
        self.send_packed(pack_frame(obj))

    def send_packed(self, data: bytes) -> None:
        """Send one frame packed already (``pack_frame(encode(msg))``: a message sent to many
        connections is encoded once)."""
        with self._send_lock:
            if self.closed:
                raise ConnectionClosed(f"control connection {self.peer} is closed")
            try:
                self._sock.sendall(data)
            except OSError as exc:
                raise ConnectionClosed(
                    f"control connection {self.peer} failed while sending: {exc}"
                ) from None

    def recv(self, timeout_s: float | None = None) -> Message:
        """The next message. TimeoutError, ConnectionClosed, or ProtocolError for garbage."""
        obj = self.recv_frame(timeout_s)
        try:
            return decode(obj)
        except ProtocolError as exc:
            raise ProtocolError(f"control connection {self.peer}: {exc}") from None

    def recv_frame(self, timeout_s: float | None = None) -> dict[str, Any]:
        """The next raw frame's map, without message checks."""
        if not self._recv_lock.acquire(timeout=-1 if timeout_s is None else max(timeout_s, 0)):
            raise TimeoutError(
                f"no message from {self.peer} within {timeout_s} s (another thread is reading)"
            )
        try:
            return self._reader.read(timeout_s)
        except ConnectionClosed:
            self.close()  # the peer went away: `closed` says so from now on
            raise
        except ProtocolError:
            if self._reader.out_of_step:
                self.close()  # no way to find the next frame: give the connection up
            raise
        finally:
            self._recv_lock.release()

    def raw_socket(self) -> socket.socket:
        """The socket, for a byte stream that follows the handshake instead of frames (the peer
        copies of the memory tier: unbroken.checkpoint.peer_copy). Only while no input is buffered
        (ProtocolError otherwise: bytes would be lost); the connection still owns and closes it."""
        if self._reader.buffered:
            raise ProtocolError(f"connection {self.peer}: frames are buffered, cannot switch to a raw stream")
        return self._sock

    def close(self) -> None:
        """Close the socket; idempotent. A blocked recv raises ConnectionClosed."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes a reader blocked in poll()
        except OSError:
            pass
        self._sock.close()


def _format_peer(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# ---------------------------------------------------------------- client and server


def connect(
    host: str, port: int, secret: bytes, role: str, ident: dict[str, Any], timeout_s: float = 5.0
) -> Connection:
    """An authenticated connection to the control server at host:port.

    Connection refused is retried until `timeout_s` (the server may not listen yet); the
    handshake then has `timeout_s` of its own. ConnectionClosed if nobody answers, AuthError
    on a wrong secret on either side, ProtocolError on a version mismatch.
    """
    _check_secret(secret)
    if not isinstance(role, str) or not role:
        raise ConfigError(f"control connection role must be a non-empty string, got {role!r}")
    if not isinstance(ident, dict):
        raise ConfigError(f"control connection ident must be a dict, got {type(ident).__name__}")
    peer = _format_peer(host, port)
    deadline = time.monotonic() + timeout_s
    delay_s = 0.05
    while True:
        try:
            attempt_s = max(deadline - time.monotonic(), 0.1)
            sock = socket.create_connection((host, port), timeout=attempt_s)
            break
        except (ConnectionRefusedError, TimeoutError) as exc:
            if time.monotonic() + delay_s > deadline:
                raise ConnectionClosed(
                    f"control connection to {peer} failed after {timeout_s} s: {exc} "
                    "(is the controller running, and is its address and port right?)"
                ) from None
            time.sleep(delay_s)
            delay_s = min(delay_s * 2, 0.5)
        except OSError as exc:
            raise ConnectionClosed(f"control connection to {peer} failed: {exc}") from None
    conn = Connection(sock, peer, role, ident)
    try:
        client_handshake(conn, secret, timeout_s)
    except BaseException:
        conn.close()
        raise
    return conn


class Server:
    """Accepts authenticated control connections and hands each to `on_connection`.

    Owns the listening socket (bound to exactly `host`, in __init__, so `port` is known
    at once; port 0 picks a free one), an accept thread (`start()`), and one thread per
    accepted connection that runs the handshake and then `on_connection(conn)`. The
    connection is closed when the handler returns or raises. A failed handshake, bad
    frame or handler error is logged with the peer and closes only that connection.
    States: listening -> serving (start) -> closed (close, idempotent).
    """

    def __init__(
        self,
        host: str,
        port: int,
        secret: bytes,
        on_connection: Callable[[Connection], None],
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        on_failed_handshakes: Callable[[int, str], None] | None = None,
    ) -> None:
        _check_secret(secret)
        if not host:
            raise ConfigError(
                "control server host is empty; give the address to listen on (e.g. 127.0.0.1)"
            )
        self.host = host
        self._secret = secret
        self._on_connection = on_connection
        self._handshake_timeout_s = handshake_timeout_s
        self._failures = _FailureLog(self, on_failed_handshakes)
        self._listener = _listen(host, port)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._live: set[Connection] = set()
        self._closing = False
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start(self) -> None:
        """Start accepting in a daemon thread."""
        with self._lock:
            if self._closing or self._thread is not None:
                where = _format_peer(self.host, self.port)
                raise RuntimeError(f"control server on {where} was already started or closed")
            self._thread = threading.Thread(
                target=self._accept_loop, name=f"unbroken-control-accept-{self.port}", daemon=True
            )
        self._thread.start()

    def close(self) -> None:
        """Stop accepting and close every live connection; idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            live = list(self._live)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept() at once on Linux
        except OSError:
            pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * WAKE_S)
        self._listener.close()
        for conn in live:
            conn.close()
        self._failures.flush()

    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                sock, addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._closing:
                    return
                logger.warning("control server on port %d: accept failed: %s", self.port, exc)
                time.sleep(WAKE_S)  # e.g. out of file descriptors: do not spin
                continue
            try:
                conn = Connection(sock, _format_peer(addr[0], addr[1]))
            except OSError as exc:  # the peer reset before we could set the socket up
                logger.warning("control connection from %s failed at once: %s", addr, exc)
                sock.close()
                continue
            with self._lock:
                if self._closing:
                    conn.close()
                    return
                self._live.add(conn)
            threading.Thread(
                target=self._serve, args=(conn,), name=f"unbroken-control-{conn.peer}", daemon=True
            ).start()

    def _serve(self, conn: Connection) -> None:
        try:
            try:
                server_handshake(conn, self._secret, self._handshake_timeout_s)
            except (ProtocolError, OSError) as exc:
                if not self._closing:
                    self._failures.add(f"{conn.peer}: {str(exc)[:500]}")
                return
            except Exception as exc:  # a bug of ours: still only this connection is lost
                logger.warning(
                    "control connection from %s failed the handshake: %s: %s",
                    conn.peer, type(exc).__name__, exc, exc_info=True,
                )
                return
            self._run_handler(conn)
        finally:
            conn.close()
            with self._lock:
                self._live.discard(conn)

    def _run_handler(self, conn: Connection) -> None:
        try:
            self._on_connection(conn)
        except ConnectionClosed as exc:  # the peer went away: normal at the end of a job
            logger.info("control connection from %s (role %r) ended: %s", conn.peer, conn.role, exc)
        except ProtocolError as exc:
            logger.warning(
                "control connection from %s (role %r) dropped: %s", conn.peer, conn.role, exc
            )
        except Exception as exc:
            logger.warning(
                "control connection from %s (role %r) dropped: handler raised %s: %s",
                conn.peer, conn.role, type(exc).__name__, exc, exc_info=True,
            )


class _FailureLog:
    """Failed handshakes of one Server, rate-limited: the first is logged at WARNING, then one
    summary (count, last failure) at most every SUMMARY_S, so a flood of connections cannot
    flood the job's output. `report(count, last)` is called with each line logged (the
    controller counts them in its event log). Called from the connection threads."""

    SUMMARY_S = 30.0

    def __init__(self, server: Server, report: Callable[[int, str], None] | None) -> None:
        self._server, self._report = server, report
        self._lock = threading.Lock()
        self._pending, self._last, self._logged_at = 0, "", None

    def add(self, what: str) -> None:
        with self._lock:
            self._pending, self._last = self._pending + 1, what
            now = time.monotonic()
            if self._logged_at is not None and now - self._logged_at < self.SUMMARY_S:
                return
            first, self._logged_at = self._logged_at is None, now
        self._emit(first)

    def flush(self) -> None:
        if self._pending:
            self._emit(False)

    def _emit(self, first: bool) -> None:
        with self._lock:
            count, last, self._pending = self._pending, self._last, 0
        if not count:
            return
        if first:
            logger.warning("control connection from %s failed the handshake (further failures are "
                           "summarised every %.0f s)", last, self.SUMMARY_S)
        else:
            logger.warning("%d control connection(s) to port %d failed the handshake in the last "
                           "%.0f s at most; the last from %s", count, self._server.port, self.SUMMARY_S, last)
        if self._report is not None:
            try:
                self._report(count, last)
            except Exception:  # an event log that fails must not break the server
                logger.debug("reporting failed handshakes raised", exc_info=True)


def _listen(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, addr = infos[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        where = _format_peer(host, port)
        raise ConfigError(f"control server cannot listen on {where}: {exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
        sock.settimeout(WAKE_S)  # the accept loop re-checks for close() this often
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"control server cannot listen on {_format_peer(host, port)}: {exc} "
            "(choose a free port, or 0 for any)"
        ) from None
    return sock


def local_address(host: str, port: int) -> str:
    """This host's address on the route to ``host`` (the controller's): where an agent's servers for its
    peers listen (peer memory, the summary tree's relay), the address the controller sees this agent connect
    from. No packet is sent."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(addr)
            return probe.getsockname()[0]
    except OSError:
        return host
