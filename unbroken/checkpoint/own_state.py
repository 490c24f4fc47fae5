"""A rank's own state in node memory, for its agent to send on when the rank dies.

In a step committed without a vote (worker/commit.py) a rank may die after its peers completed the
step's reduction but before its commit report, which carries its own state after compute, left:
the peers update, and its replacement needs that state. So as a step's reduction begins the rank
writes its own state (RNG streams, per-rank objects: the encoding the step's capture made, never
pickle) to a file in the node's shared memory, and its agent reads it when the process exits and
sends it with the exit report (agent/agent.py). Nothing more reaches the controller per step.

The file: two slots written in turn, each a header (magic, step, length) and up to
``PER_RANK_LIMIT_BYTES`` of payload. A slot's header is voided before its payload is written and
written last, so a process killed inside a write leaves the other slot, the newest complete one,
to be read. The file is the rank's own (0600, never opened through a link: shm_files.open_slot).

The writer lives in the training thread of one rank; the reader runs in its agent.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from unbroken.checkpoint.shm_files import open_ours, open_slot
from unbroken.protocol.messages import PER_RANK_LIMIT_BYTES

_HEADER = struct.Struct("<8sqQ")  # magic, step (-1: void), payload bytes
_MAGIC = b"unbrOWN1"
_VOID = _HEADER.pack(_MAGIC, -1, 0)
_SLOT_BYTES = _HEADER.size + PER_RANK_LIMIT_BYTES


class OwnStateWriter:
    """Writes one rank's own state to its file (see the module docstring); :meth:`close` removes it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = open_slot(path, truncate=True)
        os.pwrite(self._fd, _VOID, 0)
        os.pwrite(self._fd, _VOID, _SLOT_BYTES)
        self._next = 0

    def write(self, step: int, blob: bytes) -> None:
        """Keep ``blob`` (at most PER_RANK_LIMIT_BYTES: the encoder refuses more) as the state of ``step``."""
        if self._fd is None or len(blob) > PER_RANK_LIMIT_BYTES:
            return
        offset, self._next = self._next * _SLOT_BYTES, 1 - self._next
        os.pwrite(self._fd, _VOID, offset)
        os.pwrite(self._fd, blob, offset + _HEADER.size)
        os.pwrite(self._fd, _HEADER.pack(_MAGIC, step, len(blob)), offset)

    def close(self) -> None:
        if self._fd is None:
            return
        os.close(self._fd)
        self._fd = None
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


def take(path: Path) -> tuple[int, bytes] | None:
    """The newest complete ``(step, state)`` in the file at ``path``, which is then removed; None if
    there is none (no file, not ours, never written, torn)."""
    fd = open_ours(path)
    if fd is None:
        return None
    try:
        newest: tuple[int, bytes] | None = None
        for slot in (0, 1):
            header = os.pread(fd, _HEADER.size, slot * _SLOT_BYTES)
            if len(header) != _HEADER.size:
                continue
            magic, step, length = _HEADER.unpack(header)
            if magic != _MAGIC or step < 0 or length > PER_RANK_LIMIT_BYTES:
                continue
            blob = os.pread(fd, length, slot * _SLOT_BYTES + _HEADER.size)
            if len(blob) == length and (newest is None or step > newest[0]):
                newest = (step, blob)
        return newest
    except OSError:
        return None
    finally:
        os.close(fd)
        try:
            path.unlink()
        except OSError:
            pass
