"""The job's rendezvous store: one TCPStore per attempt, hosted by the controller.

A TCPStore has no authentication: any process that reaches its port can read and write
keys. What keeps such a process (one without the job secret) from breaking a job:

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

import torch.distributed as dist


#: Random bytes of a per-attempt key prefix (hex: twice as many characters).
PREFIX_BYTES = 16


def new_prefix() -> str:
    """A fresh, unguessable key prefix for one attempt's rendezvous."""
    return "rdzv-" + secrets.token_hex(PREFIX_BYTES)


def open_store(host: str) -> dist.TCPStore:
    """A master TCPStore on a free port. It still listens on every interface: handing it a
    socket bound to ``host`` (``master_listen_fd``) made `unbroken run` hang at exit after a
    plain torchrun (env://) script (tests/integration/test_bad_input.py), not solved yet."""
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, use_libuv=True)
