"""The job's rendezvous, per attempt: the key prefix, and the TCPStore of plain scripts.

Two stores serve an attempt, both hosted by the controller (so no rank's death takes
rendezvous with it):

- **the managed path** (every process that calls ``unbroken.init()``: generation 0's group,
  every regroup, :class:`~unbroken.parallel.fabric.Fabric`'s groups) uses the store served
  over the authenticated control plane (:mod:`unbroken.controller.store_service`). A
  process without the job secret cannot connect to it, so it can neither read the keys nor
  write one the job reads. Its keys also live under a random per-attempt prefix (128 bits),
  handed out only over the control plane (``StartRanks``/``RestartRank`` -> the agent ->
  the worker's environment, readable only by the job's user);
- **a plain torchrun script** (``dist.init_process_group()`` with env://, no unbroken API)
  reaches ``MASTER_ADDR:MASTER_PORT`` with torch's TCPStore client, which cannot
  authenticate. For it the controller keeps a TCPStore per attempt, listening on the job's
  address only (:class:`PlainStore`). Limit: a local process that reaches that port can read
  and write a plain script's keys (docs/security.md); the managed path reads
  nothing from it.

Runs in the controller's thread that starts an attempt. Importing torch costs seconds of CPU
(FACTS.md), and nothing else in the controller needs it: the TCPStore, and the import, come only
when a plain script first connects (:class:`PlainStore`); a job of managed ranks never pays it on
node 0, where it would compete with the ranks' own start.
"""

from __future__ import annotations

import logging
import os
import secrets
import select
import socket
import threading
from typing import TYPE_CHECKING

from unbroken.errors import ConfigError

if TYPE_CHECKING:
    import torch.distributed as dist

log = logging.getLogger(__name__)

#: Random bytes of a per-attempt key prefix (hex: twice as many characters).
PREFIX_BYTES = 16


def new_prefix() -> str:
    """A fresh, unguessable key prefix for one attempt's rendezvous."""
    return "rdzv-" + secrets.token_hex(PREFIX_BYTES)


class PlainStore:
    """One attempt's TCPStore for plain scripts, on a free port of ``host`` only (not every interface).

    Its port is known at once: the socket is bound and listening here, so the attempt's start orders
    go out without waiting for anything. A thread waits until a client connects (a plain script's
    rendezvous: its connection waits in the socket's backlog meanwhile), then imports torch and
    makes the TCPStore, which takes over the socket (``master_listen_fd``: TCPStore would otherwise
    bind every interface itself). Managed ranks never connect: their attempt never imports torch here.
    """

    def __init__(self, host: str) -> None:
        try:
            family, kind, proto, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
            sock = socket.socket(family, kind, proto)
        except OSError as exc:
            raise ConfigError(f"rendezvous store cannot listen on {host!r}: {exc} (check --master-addr)") from None
        try:
            sock.bind(addr)
            sock.listen(1024)
            self.port: int = sock.getsockname()[1]
        except OSError as exc:
            sock.close()
            raise ConfigError(f"rendezvous store cannot listen on {host!r}: {exc} (check --master-addr)") from None
        self._host, self._sock = host, sock
        self._store: dist.TCPStore | None = None
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._open, name="unbroken-tcpstore", daemon=True)
        self._thread.start()

    def _open(self) -> None:
        ready, _, _ = select.select([self._sock, self._wake_r], [], [])
        if self._closed or self._wake_r in ready:
            self._sock.close()
            return
        import torch.distributed as dist  # noqa: PLC0415  (seconds, paid only by a job with a plain script)

        if self._closed:
            self._sock.close()
            return
        fd = self._sock.detach()  # from here on the store owns (and closes) the listening socket
        try:
            self._store = dist.TCPStore(self._host, self.port, is_master=True, wait_for_workers=False,
                                        use_libuv=True, master_listen_fd=fd)
        except Exception as exc:  # noqa: BLE001 - only plain scripts use it; they fail their rendezvous
            log.warning("controller: the TCPStore for plain scripts could not start on %s:%d: %s", self._host,
                        self.port, exc)
            os.close(fd)

    def close(self, timeout_s: float = 30.0) -> None:
        """Drop the store (its destructor closes it), after its start if one is under way; idempotent."""
        if not self._closed:
            self._closed = True
            os.write(self._wake_w, b"x")
        self._thread.join(timeout_s)
        self._store = None
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_r = self._wake_w = -1
