"""The worker's rendezvous store: a ``torch.distributed.Store`` served by the controller.

:class:`ControlStore` sends each store operation as a
:class:`~unbroken.protocol.messages.StoreRequest` over its own authenticated control
connection (role ``store``, the job secret's handshake) and waits for the reply with the
same id; the controller's side is :mod:`unbroken.controller.store_service`. gloo's
rendezvous (``ProcessGroupGloo``, ``init_process_group(store=...)``, ``PrefixStore``) uses
it like a TCPStore: torch 2.13 calls ``set``, ``get`` and ``wait`` from C++ through
the Python-store trampoline (``add``, ``check``, ``compare_set``, ``deleteKey``,
``getNumKeys``, ``multi_get``/``multi_set``, ``append`` and ``clone`` are there too).
``list_keys`` is not offered: no client may list what others wrote.

Unlike a TCPStore's port, nothing here can be reached without the job secret. Values are
bytes, never unpickled.

Threads: any thread may call any operation (gloo calls them from the thread building a
group); requests are multiplexed by id, a daemon reader thread hands each reply to its
caller. The Python object must outlive every C++ holder of it (torch's trampoline finds
the Python methods through it; a ``PrefixStore`` around it does not keep it alive, hence
``key_prefix``): the worker keeps it for the life of the process, and ``clone`` returns the
same object.
"""

from __future__ import annotations

import itertools
import threading
from datetime import timedelta

import torch.distributed as dist

from unbroken.errors import ConnectionClosed, ProtocolError
from unbroken.protocol import messages as m
from unbroken.protocol.wire import Connection, connect

#: How much longer than the operation's own timeout the client waits for the controller's reply.
REPLY_GRACE_S = 10.0


class ControlStore(dist.Store):
    """One process's store client (see the module docstring). Owns its control connection
    and the reader thread; :meth:`close` ends both."""

    def __init__(self, host: str, port: int, secret: bytes, *, rank: int, attempt: int, pid: int,
                 timeout_s: float, key_prefix: str = "", connect_timeout_s: float = 10.0) -> None:
        super().__init__()
        self._prefix = f"{key_prefix}/" if key_prefix else ""
        self.set_timeout(timedelta(seconds=timeout_s))
        self._conn: Connection = connect(host, port, secret, "store",
                                         {"rank": rank, "attempt": attempt, "pid": pid},
                                         timeout_s=connect_timeout_s)
        self._ids = itertools.count(1)
        self._pending: set[int] = set()  # ids still awaited: a reply after its caller gave up is dropped
        self._replies: dict[int, m.StoreReply] = {}
        self._cv = threading.Condition()
        self._lost = ""  # why the connection ended, once it has
        self._reader = threading.Thread(target=self._read_loop, name=f"unbroken-store-r{rank}", daemon=True)
        self._reader.start()

    # -- the torch Store interface ---------------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        self._call("set", [key], [_as_bytes(value)])

    def get(self, key: str) -> bytes:
        return self._call("get", [key], blocking_s=self._timeout_s()).values[0]

    def add(self, key: str, amount: int) -> int:
        return self._call("add", [key], amount=int(amount)).number

    def compare_set(self, key: str, expected_value: bytes | str, desired_value: bytes | str) -> bytes:
        return self._call("compare_set", [key], [_as_bytes(expected_value), _as_bytes(desired_value)]).values[0]

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", list(keys)).number)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        wait_s = self._timeout_s() if timeout is None else timeout.total_seconds()
        self._call("wait", list(keys), blocking_s=wait_s)

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete_key", [key]).number)

    def num_keys(self) -> int:
        return self._call("num_keys", []).number

    def append(self, key: str, value: bytes | str) -> None:
        self._call("append", [key], [_as_bytes(value)])

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call("multi_get", list(keys), blocking_s=self._timeout_s()).values

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        self._call("multi_set", list(keys), [_as_bytes(v) for v in values])

    # The names torch's C++ trampoline looks up for these two (PYBIND11_OVERLOAD_PURE).
    deleteKey = delete_key  # noqa: N815
    getNumKeys = num_keys  # noqa: N815

    def clone(self) -> ControlStore:
        """The same store: it is thread-safe, and a new Python object could die before its C++ holder."""
        return self

    def list_keys(self) -> list[str]:
        raise dist.DistStoreError("the unbroken rendezvous store does not list its keys (no client may read "
                                  "what it did not name)")

    def close(self) -> None:
        """Close the connection; operations after this raise DistStoreError."""
        self._conn.close()

    # -- requests and replies --------------------------------------------------------------
    def _timeout_s(self) -> float:
        return self.timeout.total_seconds()

    def _call(self, op: str, keys: list[str], values: list[bytes] = (), *, amount: int = 0,
              blocking_s: float = 0.0) -> m.StoreReply:
        req_id = next(self._ids)
        req = m.StoreRequest(id=req_id, op=op, keys=[self._prefix + k for k in keys], values=list(values),
                             amount=amount, timeout_ms=max(int(blocking_s * 1000), 0))
        with self._cv:
            self._pending.add(req_id)
        try:
            self._conn.send(req)
            reply = self._await(req_id, blocking_s + REPLY_GRACE_S, op, keys)
        except (ConnectionClosed, ProtocolError) as exc:
            raise dist.DistStoreError(f"rendezvous store {op} of {keys[:4]!r}: {exc}") from None
        finally:
            with self._cv:
                self._pending.discard(req_id)
                self._replies.pop(req_id, None)
        if reply.ok:
            return reply
        if reply.timed_out:
            raise dist.DistStoreError(f"rendezvous store: {reply.error} (the store's timeout; under "
                                      "`unbroken run` the process-group timeout, --pg-timeout-s)")
        raise dist.DistStoreError(f"rendezvous store refused {op} of {keys[:4]!r}: {reply.error}")

    def _await(self, req_id: int, wait_s: float, op: str, keys: list[str]) -> m.StoreReply:
        with self._cv:
            if not self._cv.wait_for(lambda: req_id in self._replies or self._lost, timeout=wait_s):
                raise dist.DistStoreError(f"rendezvous store {op} of {keys[:4]!r}: no reply from the "
                                          f"controller within {wait_s:g} s")
            reply = self._replies.pop(req_id, None)
        if reply is None:
            raise dist.DistStoreError(f"rendezvous store {op} of {keys[:4]!r}: {self._lost}")
        return reply

    def _read_loop(self) -> None:
        why = "the connection to the controller's store closed"
        while True:
            try:
                reply = self._conn.recv()
            except (ConnectionClosed, OSError) as exc:
                why = f"the connection to the controller's store closed ({exc})"
                break
            except ProtocolError as exc:  # the controller sent garbage: nothing after it is trusted
                why = f"the controller's store sent a malformed reply ({exc})"
                self._conn.close()
                break
            if isinstance(reply, m.StoreReply):
                with self._cv:
                    if reply.id in self._pending:
                        self._replies[reply.id] = reply
                        self._cv.notify_all()
        with self._cv:
            self._lost = why
            self._cv.notify_all()


def _as_bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def open_store(controller: str, secret: str, *, rank: int, attempt: int, pid: int, timeout_s: float,
               key_prefix: str = "") -> ControlStore:
    """A :class:`ControlStore` to the controller at ``controller`` ("host:port"), every key
    under ``key_prefix``."""
    host, _, port = controller.rpartition(":")
    return ControlStore(host.strip("[]"), int(port), secret.encode(), rank=rank, attempt=attempt, pid=pid,
                        timeout_s=timeout_s, key_prefix=key_prefix)
