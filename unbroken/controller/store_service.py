"""The job's rendezvous store, served by the controller over the authenticated control plane.

Each worker opens one control connection with role ``store`` (the same HMAC handshake as
every connection: a process without the job secret cannot connect, read or write a key)
and sends :class:`~unbroken.protocol.messages.StoreRequest` frames; each gets one
:class:`~unbroken.protocol.messages.StoreReply` with the request's id. Values are bytes,
never unpickled. The worker's side is :class:`unbroken.worker.store_client.ControlStore`,
a ``torch.distributed.Store`` that gloo's rendezvous uses like a TCPStore.

:class:`StoreService` owns one table of keys per attempt (a new attempt drops the older
ones: no stale rendezvous key survives a restart, and a process of an older attempt gets
an error, never the new attempt's keys). A ``get``/``wait``/``multi_get`` of missing keys
blocks until they are set or its timeout ends; the reply then comes from the thread that set
the key, or from the waiting connection's own thread at the deadline. Sizes are bounded
(``STORE_MAX_*`` in messages.py); a malformed or oversized request gets an error reply,
and only its connection is affected.

Threads: :meth:`StoreService.serve` runs in the protocol server's thread of each store
connection; :meth:`StoreService.open_attempt` in the controller's thread that starts an
attempt. One lock guards the tables; replies are sent after it is released.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from unbroken.errors import ConnectionClosed, ProtocolError
from unbroken.protocol import messages as m
from unbroken.protocol.wire import Connection

log = logging.getLogger(__name__)

#: How long a serving thread waits for a request when none of its requests is blocked.
IDLE_WAKE_S = 0.5
_INT64 = (-(1 << 63), (1 << 63) - 1)
_MAX_TIMEOUT_MS = 86_400_000


class StoreRefused(Exception):
    """A request the store does not carry out; the message goes back to the caller."""


@dataclasses.dataclass(eq=False)
class _Waiter:
    """A blocked get/wait/multi_get: answered when every key is set, or at ``deadline``."""

    conn: Connection
    req: m.StoreRequest
    deadline: float
    key: str = ""  # the missing key it is filed under


class _Table:
    """One attempt's keys (str -> bytes) and the requests blocked on them. Guarded by the
    service's lock.

    A blocked request is filed under one key it misses and under its connection, so a write
    looks only at the requests filed under the keys it wrote, and a connection's deadline and
    count only at its own (at most STORE_MAX_WAITS): O(1) per operation, whatever the number of
    ranks blocked at once (a scan of every waiter per request was O(N^2) per regroup)."""

    def __init__(self, attempt: int) -> None:
        self.attempt = attempt
        self.data: dict[str, bytes] = {}
        self.total_bytes = 0
        self._by_key: dict[str, dict[int, _Waiter]] = {}
        self._by_conn: dict[int, dict[int, _Waiter]] = {}

    # -- writes --------------------------------------------------------------------------
    def put(self, key: str, value: bytes) -> None:
        old = self.data.get(key)
        grow = len(value) - len(old) if old is not None else len(key.encode()) + len(value)
        if old is None and len(self.data) >= m.STORE_MAX_KEYS:
            raise StoreRefused(f"the store holds {m.STORE_MAX_KEYS} keys already (the limit per attempt)")
        if self.total_bytes + grow > m.STORE_MAX_TOTAL_BYTES:
            raise StoreRefused(f"the store would hold over {m.STORE_MAX_TOTAL_BYTES} bytes (the limit per attempt)")
        self.data[key] = value
        self.total_bytes += grow

    def delete(self, key: str) -> bool:
        value = self.data.pop(key, None)
        if value is None:
            return False
        self.total_bytes -= len(key.encode()) + len(value)
        return True

    # -- blocked requests ----------------------------------------------------------------
    def block(self, w: _Waiter) -> None:
        """File ``w`` (some of its keys are missing) until they are set or it expires."""
        self._file(w)
        self._by_conn.setdefault(id(w.conn), {})[id(w)] = w

    def blocked_on(self, conn: Connection) -> int:
        return len(self._by_conn.get(id(conn), ()))

    def ready(self, written: list[str]) -> list[_Waiter]:
        """Remove and return the waiters whose keys are all set now that ``written`` were."""
        done: list[_Waiter] = []
        for key in written:
            for w in self._by_key.pop(key, {}).values():
                if self._file(w):
                    continue
                self._by_conn[id(w.conn)].pop(id(w))
                done.append(w)
        return done

    def expired(self, conn: Connection, now: float) -> list[_Waiter]:
        """Remove and return ``conn``'s waiters past their deadline."""
        return self._remove([w for w in self._by_conn.get(id(conn), {}).values() if w.deadline <= now])

    def next_deadline(self, conn: Connection) -> float | None:
        return min((w.deadline for w in self._by_conn.get(id(conn), {}).values()), default=None)

    def drop(self, conn: Connection) -> None:
        """Forget ``conn``'s waiters (it closed)."""
        self._remove(list(self._by_conn.get(id(conn), {}).values()))

    def all_waiters(self) -> list[_Waiter]:
        return [w for ws in self._by_conn.values() for w in ws.values()]

    def _file(self, w: _Waiter) -> bool:
        """File ``w`` under a key it misses; False if it misses none."""
        missing = next((k for k in w.req.keys if k not in self.data), None)
        if missing is None:
            return False
        w.key = missing
        self._by_key.setdefault(missing, {})[id(w)] = w
        return True

    def _remove(self, waiters: list[_Waiter]) -> list[_Waiter]:
        for w in waiters:
            self._by_conn[id(w.conn)].pop(id(w), None)
            filed = self._by_key.get(w.key)
            if filed is not None:
                filed.pop(id(w), None)
                if not filed:
                    del self._by_key[w.key]
        return waiters


class StoreService:
    """Every attempt's rendezvous keys and the store connections (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tables: dict[int, _Table] = {}
        self._closed = False

    def open_attempt(self, attempt: int) -> None:
        """Start ``attempt``'s empty table; older attempts' keys go, their blocked requests fail."""
        with self._lock:
            old = [w for t in self._tables.values() for w in t.all_waiters()]
            self._tables = {attempt: _Table(attempt)}
        self._fail(old, f"attempt {attempt} started: the store of the older attempt is gone")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            old = [w for t in self._tables.values() for w in t.all_waiters()]
            self._tables = {}
        self._fail(old, "the controller is closing")

    def keys_of(self, attempt: int) -> dict[str, bytes]:
        """A copy of ``attempt``'s keys (tests, diagnostics)."""
        with self._lock:
            table = self._tables.get(attempt)
            return dict(table.data) if table else {}

    # -- serving one connection ------------------------------------------------------------
    def serve(self, conn: Connection) -> None:
        """Answer ``conn``'s requests until it closes (the protocol server's thread for it)."""
        attempt = conn.ident.get("attempt")
        if type(attempt) is not int:
            raise ProtocolError(f"store connection {conn.peer}: its hello must name the attempt (an int)")
        try:
            while not self._closed:
                self._serve_one(conn, attempt)
                self._expire(conn, attempt)
        finally:
            with self._lock:
                table = self._tables.get(attempt)
                if table is not None:
                    table.drop(conn)

    def _serve_one(self, conn: Connection, attempt: int) -> None:
        with self._lock:
            table = self._tables.get(attempt)
            deadline = table.next_deadline(conn) if table else None
        wait_s = IDLE_WAKE_S if deadline is None else min(IDLE_WAKE_S, max(deadline - time.monotonic(), 0.0))
        try:
            msg = conn.recv(timeout_s=wait_s)
        except TimeoutError:
            return
        except ProtocolError as exc:  # a frame that is no valid message: say so, keep serving
            if conn.closed:  # (the client is gone, e.g. a lost rank's process: this thread ends)
                raise
            _send(conn, m.StoreReply(id=-1, ok=False, error=f"malformed store request: {exc}"))
            return
        if not isinstance(msg, m.StoreRequest):
            _send(conn, m.StoreReply(id=-1, ok=False, error=f"a store connection takes store_request "
                                                            f"messages only, not {msg.TYPE!r}"))
            return
        for target, reply in self.handle(conn, attempt, msg):
            _send(target, reply)

    def _expire(self, conn: Connection, attempt: int) -> None:
        with self._lock:
            table = self._tables.get(attempt)
            done = table.expired(conn, time.monotonic()) if table else []
        for w in done:
            _send(w.conn, _timed_out(w.req))

    def handle(self, conn: Connection, attempt: int, req: m.StoreRequest) -> list[tuple[Connection, m.StoreReply]]:
        """Carry out ``req`` for ``attempt``: the replies to send (this one's, if not blocked, and
        those of requests its write unblocked)."""
        with self._lock:
            table = self._tables.get(attempt)
            try:
                if table is None:
                    raise StoreRefused(f"attempt {attempt} is over (or not started): its store is gone")
                _check(req)
                reply = _OPS[req.op](table, req)
            except StoreRefused as exc:
                return [(conn, m.StoreReply(id=req.id, ok=False, error=str(exc)))]
            if reply is None:  # blocked on missing keys
                if req.timeout_ms == 0:
                    return [(conn, _timed_out(req))]
                if table.blocked_on(conn) >= m.STORE_MAX_WAITS:
                    return [(conn, m.StoreReply(id=req.id, ok=False, error=(
                        f"over {m.STORE_MAX_WAITS} blocked get/wait requests on one connection")))]
                table.block(_Waiter(conn, req, time.monotonic() + req.timeout_ms / 1000))
                return []
            written = req.keys if req.op in _WRITES else []
            unblocked = [(w.conn, _answer_ready(table, w.req)) for w in table.ready(written)]
        return [(conn, reply), *unblocked]

    def _fail(self, waiters: list[_Waiter], why: str) -> None:
        for w in waiters:
            _send(w.conn, m.StoreReply(id=w.req.id, ok=False, error=why))


# -- the operations (under the service's lock) ----------------------------------------------
def _check(req: m.StoreRequest) -> None:
    """StoreRefused unless ``req`` is a well-formed request within the limits."""
    if req.op not in _OPS:
        raise StoreRefused(f"unknown store operation {req.op!r} (allowed: {', '.join(m.STORE_OPS)})")
    if len(req.keys) > m.STORE_MAX_KEYS_PER_REQUEST:
        raise StoreRefused(f"{len(req.keys)} keys in one request (at most {m.STORE_MAX_KEYS_PER_REQUEST})")
    for key in req.keys:
        if not key or len(key) > m.STORE_MAX_KEY_CHARS:
            raise StoreRefused(f"store key of {len(key)} characters (allowed: 1..{m.STORE_MAX_KEY_CHARS})")
    for value in req.values:
        if len(value) > m.STORE_MAX_VALUE_BYTES:
            raise StoreRefused(f"store value of {len(value)} bytes (at most {m.STORE_MAX_VALUE_BYTES})")
    if req.timeout_ms > _MAX_TIMEOUT_MS:
        raise StoreRefused(f"store timeout of {req.timeout_ms} ms (at most {_MAX_TIMEOUT_MS})")
    keys, values = _SHAPES[req.op]
    if (keys is not None and len(req.keys) != keys) or (keys is None and not req.keys) or \
            (values == "keys" and len(req.values) != len(req.keys)) or \
            (values != "keys" and len(req.values) != values):
        raise StoreRefused(f"store operation {req.op!r} got {len(req.keys)} key(s) and {len(req.values)} "
                           f"value(s) ({_shape_text(keys, values)})")


def _shape_text(keys: int | None, values: int | str) -> str:
    k = "one or more keys" if keys is None else f"{keys} key(s)"
    v = "one value per key" if values == "keys" else f"{values} value(s)"
    return f"it takes {k} and {v}"


def _set(table: _Table, req: m.StoreRequest) -> m.StoreReply:
    table.put(req.keys[0], req.values[0])
    return m.StoreReply(id=req.id, ok=True)


def _multi_set(table: _Table, req: m.StoreRequest) -> m.StoreReply:
    for key, value in zip(req.keys, req.values):
        table.put(key, value)
    return m.StoreReply(id=req.id, ok=True)


def _append(table: _Table, req: m.StoreRequest) -> m.StoreReply:
    key = req.keys[0]
    table.put(key, table.data.get(key, b"") + req.values[0])
    return m.StoreReply(id=req.id, ok=True)


def _add(table: _Table, req: m.StoreRequest) -> m.StoreReply:
    key = req.keys[0]
    raw = table.data.get(key, b"0")
    try:
        number = int(raw.decode("ascii")) + req.amount
    except (UnicodeDecodeError, ValueError):
        raise StoreRefused(f"add on key {key!r}, whose value is not a decimal integer") from None
    if not _INT64[0] <= number <= _INT64[1]:
        raise StoreRefused(f"add on key {key!r} overflows a 64-bit integer")
    table.put(key, str(number).encode("ascii"))
    return m.StoreReply(id=req.id, ok=True, number=number)


def _compare_set(table: _Table, req: m.StoreRequest) -> m.StoreReply:
    """TCPStore's semantics: a missing key is set only when ``expected`` is empty; the reply is
    the value now held (or ``expected`` when the key stays missing)."""
    key, (expected, desired) = req.keys[0], req.values
    current = table.data.get(key)
    if current is None:
        if expected:
            return m.StoreReply(id=req.id, ok=True, values=[expected])
        table.put(key, desired)
    elif current == expected:
        table.put(key, desired)
    return m.StoreReply(id=req.id, ok=True, values=[table.data[key]])


def _get(table: _Table, req: m.StoreRequest) -> m.StoreReply | None:
    return _answer_ready(table, req) if all(k in table.data for k in req.keys) else None


def _check_keys(table: _Table, req: m.StoreRequest) -> m.StoreReply:
    return m.StoreReply(id=req.id, ok=True, number=int(all(k in table.data for k in req.keys)))


def _delete(table: _Table, req: m.StoreRequest) -> m.StoreReply:
    return m.StoreReply(id=req.id, ok=True, number=int(table.delete(req.keys[0])))


def _num_keys(table: _Table, req: m.StoreRequest) -> m.StoreReply:
    return m.StoreReply(id=req.id, ok=True, number=len(table.data))


def _answer_ready(table: _Table, req: m.StoreRequest) -> m.StoreReply:
    """The reply to a get/wait/multi_get whose keys are all set."""
    values = [] if req.op == "wait" else [table.data[k] for k in req.keys]
    return m.StoreReply(id=req.id, ok=True, values=values)


def _timed_out(req: m.StoreRequest) -> m.StoreReply:
    return m.StoreReply(id=req.id, ok=False, timed_out=True, error=(
        f"store {req.op} of {req.keys[:4]!r}: not set within {req.timeout_ms / 1000:g} s"))


def _send(conn: Connection, reply: m.StoreReply) -> None:
    try:
        conn.send(reply)
    except (ConnectionClosed, ProtocolError, OSError) as exc:
        log.debug("store reply %d to %s not sent: %s", reply.id, conn.peer, exc)


_OPS = {
    "set": _set, "get": _get, "add": _add, "compare_set": _compare_set, "check": _check_keys, "wait": _get,
    "delete_key": _delete, "num_keys": _num_keys, "append": _append, "multi_get": _get, "multi_set": _multi_set,
}
_WRITES = frozenset({"set", "add", "compare_set", "append", "multi_set"})  # may set a missing key
# op -> (number of keys, None: one or more; number of values, "keys": one per key)
_SHAPES: dict[str, tuple[int | None, int | str]] = {
    "set": (1, 1), "get": (1, 0), "add": (1, 0), "compare_set": (1, 2), "check": (None, 0), "wait": (None, 0),
    "delete_key": (1, 0), "num_keys": (0, 0), "append": (1, 1), "multi_get": (None, 0), "multi_set": (None, "keys"),
}
assert set(_OPS) == set(_SHAPES) == set(m.STORE_OPS)
