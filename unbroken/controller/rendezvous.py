"""The job's rendezvous store: one TCPStore per attempt, hosted by the controller.

A TCPStore has no authentication: any process that reaches its port can read and write
keys. Two things keep such a process (one without the job secret) from breaking a job:

- the store listens only on the address the job uses (``--master-addr``), not on every
  interface;
- every key the job uses lives under a random per-attempt prefix (128 bits) that the
  controller hands out only over the authenticated control plane (``StartWorkers``,
  ``RestartWorker`` -> the agent -> the worker's environment, readable only by the job's
  user). Guessed or old-style keys (``gen0/...``, ``gen1//0/1``) touch nothing the job reads.

Limit: TCPStore's ``list_keys`` lets a client that reaches the port read the prefix; a local
attacker who does so can still disturb a rendezvous (see README, "Security model").
Runs in the controller's thread that starts an attempt.
"""

from __future__ import annotations

import secrets
import socket

import torch.distributed as dist

from unbroken.errors import ConfigError

#: Random bytes of a per-attempt key prefix (hex: twice as many characters).
PREFIX_BYTES = 16


def new_prefix() -> str:
    """A fresh, unguessable key prefix for one attempt's rendezvous."""
    return "rdzv-" + secrets.token_hex(PREFIX_BYTES)


def open_store(host: str) -> dist.TCPStore:
    """A master TCPStore listening on ``host`` only (a free port); the store owns the socket."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ConfigError(f"rendezvous store cannot listen on {host!r}: {exc} (check --master-addr)") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(1024)
        port = sock.getsockname()[1]
    except OSError as exc:
        sock.close()
        raise ConfigError(f"rendezvous store cannot listen on {host!r}: {exc} (check --master-addr)") from None
    fd = sock.detach()  # from here on the store owns (and closes) the listening socket
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, use_libuv=True, master_listen_fd=fd)
